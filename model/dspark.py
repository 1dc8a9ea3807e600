"""DSpark: the block drafter of V4.1 (ARCHITECTURE.md §2.11) and speculative generation with it.

Owns:
- the draft stages ``mtp.K`` (:class:`DSpark`, attached to the Transformer as ``model.mtp``):
  window-only blocks with their own MoE and mHC, the context projection ``main_proj`` /
  ``main_norm`` on stage 0, and the final ``norm``, Markov head and confidence head on the
  last stage. Names are the checkpoint's (§3.3), so loading is a name-for-name copy;
- the drafter's own window state (:class:`DraftContext`): per stage, FP8 entries made from
  the context feature c_t of every position the target has run;
- :class:`Speculator`: draft a block, choose how many tokens to verify from the confidence
  head, verify them in ONE forward of the target, accept (greedy: longest agreeing prefix;
  sampling: speculative rejection sampling against the draft's shaped distribution) and roll
  the target cache back to exactly the accepted length with ``Cache.truncate``.

Context feature: c_t = main_norm(main_proj([tap_l(t) for l in dspark_target_layer_ids])),
tap_l = the input streams of target layer l (after Engram) averaged over the hc streams
(§7 question 1, [INF]). The last stage collapses with its lagged ``pre`` (no ``hc_head`` in
V4.1, §7 question 2, [INF]); stages have a shared expert and gate ``bias_vl`` (question 3).
Block position i (anchor at i = 0) predicts the token at anchor_pos + i + 1, so a block of
``dspark_block_size`` queries proposes up to that many tokens.

Correctness never depends on the draft: a stale or wrong draft context only lowers the
acceptance. Does not own the target network (``model.model``, ``model.block``), the cache layout
(``model.cache``) or plain decoding and sampling (``model.engine``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from torch import nn

from model import decode_step
from model.args import ModelArgs
from model.cache import Cache, WindowRing
from model.engine import Engine, Sampling, State, shaped_probs  # the same shaping as plain sampling
from model.layer import RMSNorm, Step, embedding
from model.linear import ALONE, Linear, World, grouped_linear
from model.block import Attention, Block, hc_collapse
from model.moe import MoE
from model.quant import fake_quant_fp8, straight_through
from model.rope import apply_rope

if TYPE_CHECKING:
    from model.model import Transformer


class SpeculationUnavailable(ValueError):
    """Speculative decoding was asked of a model that cannot do it."""


# ----------------------------------------------------------------------------- draft stages

class DraftAttention(Attention):
    """A draft stage's attention: the block's queries see the stage's context entries of the
    newest ``sliding_window`` positions before the anchor and every block position (both
    directions). Same tensors as a window-only backbone layer; main RoPE."""

    def __init__(self, args: ModelArgs, stage: int, world: World = ALONE):
        nn.Module.__init__(self)
        self.args, self.stage, self.layer, self.ratio = args, stage, args.num_hidden_layers + stage, 0
        self._projections(args, world)  # over a world, split as a backbone layer's
        self.compressor = self.indexer = None

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor, ropes) -> torch.Tensor:
        """Context entries (pre-FP8) of features c [B, S, D]: this stage's wkv, kv_norm, RoPE."""
        return apply_rope(self.kv_norm(self.wkv(c)), positions, ropes.main)

    def forward(self, x: torch.Tensor, step: Step, ctx, ropes) -> torch.Tensor:
        """Blocks x [B, S, D] against the context entries ``ctx.window`` gives this stage:
        (entries [b, L, hd], which of them each block sees [b, L], the block positions [S]
        shared by every row or [B, S] one row each); b is 1 (shared) or B."""
        B, S, _ = x.shape
        old, seen, pos = ctx.window(self, step, ropes)
        q_res = self.q_norm(self.wq_a(x))
        q = rope_rows(self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim), pos, ropes.main)
        kv = fp8_entries(rope_rows(self.kv_norm(self.wkv(x)), pos, ropes.main))
        mask = torch.cat([seen[:, None, :].expand(-1, S, -1),
                          torch.ones(seen.shape[0], S, S, dtype=torch.bool, device=x.device)], dim=-1)
        keys = torch.cat([old.to(kv.dtype).expand(B, -1, -1), kv], dim=1)
        out = rope_rows(self.attend(q, keys, mask, None), pos, ropes.main, inverse=True)
        return self.wo_b(grouped_linear(self.wo_a, out.flatten(2), self.o_groups))


def rope_rows(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``apply_rope`` at positions [S] shared by the rows of x [B, S, ...], or [B, S] one row each."""
    if pos.dim() == 1:
        return apply_rope(x, pos, inv_freq, inverse=inverse)
    flat = x.reshape(1, -1, *x.shape[2:])
    return apply_rope(flat, pos.reshape(-1), inv_freq, inverse=inverse).view_as(x)


def fp8_entries(kv: torch.Tensor) -> torch.Tensor:
    """Entries as the FP8 ring holds them; the identity's gradient where one is wanted (training)."""
    q = fake_quant_fp8(kv.detach())
    return straight_through(kv, q) if kv.requires_grad else q


class MarkovHead(nn.Module):
    """Low-rank first-order bias: logits_k += head(embed(previous token))."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(prev)).float()


class ConfidenceHead(nn.Module):
    """Predicted probability that a proposal is accepted: sigmoid(proj [h ; markov embed(prev)])."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)

    def logit(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([h, prev_emb.to(h.dtype)], dim=-1)).float().squeeze(-1)

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h, prev_emb))


class DraftStage(Block):
    """One draft stage ``mtp.K``: the backbone's lagged-mHC block (its forward is reused) with
    a :class:`DraftAttention`, a DSpark-sized MoE and no Engram; stage 0 also owns the context
    projection, the last stage the final norm and the two heads."""

    def __init__(self, args: ModelArgs, stage: int, world: World = ALONE):
        nn.Module.__init__(self)
        self.args, self.layer = args, args.num_hidden_layers + stage
        self.attn = DraftAttention(args, stage, world)
        self.ffn = MoE(args, args.dspark_n_routed_experts, args.dspark_num_experts_per_tok, world=world)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.engram = None
        mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, width)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        D = args.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(args.dspark_target_layer_ids) * D, D)
            self.main_norm = RMSNorm(D, args.rms_norm_eps)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(D, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(D + args.dspark_markov_rank)


@dataclass
class DraftBlock:
    """What one draft forward proposes: tokens, their shaped draft distributions (None when
    greedy) and the confidence of each proposal."""
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)


class DSpark(nn.ModuleList):
    """The draft stages; item K is ``mtp.K``. Shares ``embed``, ``head`` and the RoPE tables
    with the target, which it is given at call time (it is a submodule of the target)."""

    def __init__(self, args: ModelArgs, world: World = ALONE):
        """``world``: each stage split over its ranks as a backbone layer is (attention heads,
        routed experts); the context projection, norms and heads whole on every rank."""
        super().__init__([DraftStage(args, k, world) for k in range(args.num_nextn_predict_layers)])
        self.args = args

    def context(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """c_t [B, S, D] from the target layers' taps (each [B, S, D])."""
        x = torch.cat([taps[layer] for layer in self.args.dspark_target_layer_ids], dim=-1)
        return self[0].main_norm(self[0].main_proj(x.to(self[0].main_norm.weight.dtype)))

    def add_context(self, ctx: "DraftContext", taps: dict[int, torch.Tensor], start: int, ropes) -> None:
        """Append the context entries of positions [start, start + S) to every stage's ring."""
        c = self.context(taps)
        positions = torch.arange(start, start + c.shape[1], device=c.device)
        for stage, ring in zip(self, ctx.rings):
            ring.write(stage.attn.context_kv(c, positions, ropes), positions)
        ctx.length = start + c.shape[1]

    def hidden(self, target: Transformer, anchor: int, start: int, ctx: "DraftContext") -> torch.Tensor:
        """Normed hidden [S, D] of the block [anchor, noise...] at positions start.. (S = block size)."""
        anchors = torch.tensor([anchor], device=target.device)
        return self.hidden_rows(target, anchors, Step(start=start, length=self.args.dspark_block_size), ctx)[0]

    def hidden_rows(self, target: Transformer, anchors: torch.Tensor, step: Step, ctx) -> torch.Tensor:
        """Normed hidden [N, S, D] of N blocks [anchor_n, noise...]; where each block sits and
        what context it sees is ``ctx.window``'s (one block at ``step``'s positions in
        decoding, many at their own in training: ``model.draft_training``)."""
        a = self.args
        ids = torch.full((anchors.shape[0], a.dspark_block_size), a.dspark_noise_token_id, device=anchors.device)
        ids[:, 0] = anchors
        streams = target.embed(ids).unsqueeze(2).expand(-1, -1, a.hc_mult, -1).contiguous()
        pre = torch.zeros(*streams.shape[:-1], dtype=torch.float32, device=streams.device)
        pre[..., 0] = 1.0
        for stage in self:
            streams, pre = stage(streams, pre, step, ctx, target.ropes)
        return self[-1].norm(hc_collapse(streams, pre))

    def block_logits(self, target: Transformer, anchor: int, start: int,
                     ctx: "DraftContext") -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden [S, D], the target head's logits [S, vocab]) of the block at ``start``:
        the model calls of a proposal. Over several ranks the embedding and the head are split
        (their collectives are here) and the stages are whole; what :meth:`propose` does with
        them is one rank's alone."""
        h = self.hidden(target, anchor, start, ctx)
        return h, target.world.gather(target.head(h)).float()

    def propose(self, target: Transformer, anchor: int, start: int, ctx: "DraftContext", n: int,
                params: Sampling, generator: torch.Generator | None) -> DraftBlock:
        """Up to ``n`` proposals, left to right through the Markov head (prev = anchor, then
        each proposal); greedy takes the argmax, sampling draws from the shaped distribution."""
        h, base = self.block_logits(target, anchor, start, ctx)
        last, out, prev = self[-1], DraftBlock(), anchor
        for i in range(min(n, h.shape[0])):
            prev_t = torch.tensor(prev, device=h.device)
            logits = base[i] + last.markov_head(prev_t)
            out.confidence.append(float(last.confidence_head(h[i], last.markov_head.embed(prev_t))))
            probs = None if params.temperature <= 0 else shaped_probs(logits, params)
            prev = int(logits.argmax()) if probs is None else int(torch.multinomial(probs.cpu(), 1, generator=generator))
            out.tokens.append(prev)
            out.probs.append(probs)
        return out


class DraftContext:
    """The drafter's window state: per stage a ring of FP8 context entries (keys from c_t),
    for positions [length - window - spare, length)."""

    def __init__(self, args: ModelArgs, device, spare: int):
        cap = args.sliding_window + spare  # spare slots: a generator closed mid-block rolls back
        self.rings = [WindowRing(1, cap, args.head_dim, device) for _ in range(args.num_nextn_predict_layers)]
        self.length = 0  # the next position to receive an entry

    def truncate(self, length: int) -> None:
        for ring in self.rings:
            ring.truncate(length)
        self.length = min(self.length, length)

    def window(self, attn: DraftAttention, step: Step, ropes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stage's ring entries, those of the ``sliding_window`` positions before the block,
        and the block's positions (``DraftAttention.forward``)."""
        old, old_pos = self.rings[attn.stage].read()
        seen = (old_pos >= 0) & (old_pos < step.start) & (old_pos >= step.start - attn.args.sliding_window)
        return old, seen[None], step.positions(old.device)


# ----------------------------------------------------------------------------- sampling helpers

def choose_gamma(confidence: Sequence[float], extra_token_cost: float, cap: int) -> int:
    """How many proposals to verify: the γ in [1, cap] maximising expected tokens per unit of
    target time. Reading confidence[i] as P(proposal i accepted | all before it were), a
    verification of γ proposals emits E(γ) = 1 + Σ_{j<γ} Π_{i<=j} confidence[i] tokens (the
    bonus token is free) and costs 1 + extra_token_cost·γ decode steps. Ties go to the
    shorter block. ``cap`` <= 0 means verify the anchor alone (a plain decode step)."""
    best, best_rate, expected, alive = 0, 1.0, 1.0, 1.0
    for g in range(1, min(cap, len(confidence)) + 1):
        alive *= confidence[g - 1]
        expected += alive
        rate = expected / (1.0 + extra_token_cost * g)
        if g == 1 or rate > best_rate:
            best, best_rate = g, rate
    return best


def accept_greedy(proposals: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count k, bonus token): the longest prefix that equals the target's argmax."""
    target = logits.argmax(-1).tolist()
    k = next((i for i, t in enumerate(proposals) if t != target[i]), len(proposals))
    return k, target[k]


def accept_sampled(block: DraftBlock, gamma: int, logits: torch.Tensor, params: Sampling,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling: accept proposal i with probability min(1, p_i/q_i);
    at the first rejection draw from norm(max(0, p_i - q_i)); after γ acceptances draw the
    bonus from p_γ. The emitted tokens are distributed exactly as plain sampling's."""
    for i in range(gamma):
        p, q, token = shaped_probs(logits[i], params).cpu(), block.probs[i].cpu(), block.tokens[i]
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp_min(0)
        residual = residual if float(residual.sum()) > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    p = shaped_probs(logits[gamma], params).cpu()
    return gamma, int(torch.multinomial(p, 1, generator=generator))


# ----------------------------------------------------------------------------- speculation

@dataclass
class SpecStats:
    """Counters of one speculator; ratios are per target verification forward."""
    forwards: int = 0  # target forwards that verified a block
    drafted: int = 0  # proposals sent to verification
    accepted: int = 0  # proposals accepted
    emitted: int = 0  # tokens those forwards produced (accepted + bonus, before stop/limit cuts)

    @property
    def mean_accepted(self) -> float:
        return self.accepted / max(1, self.forwards)

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / max(1, self.forwards)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)


def has_draft_stages(model: Transformer) -> bool:
    return isinstance(getattr(model, "mtp", None), DSpark)


@dataclass
class _Round:
    """One verification: the cache holds anchor + proposals at [n, n + γ + 1)."""
    n: int
    logits: torch.Tensor  # [γ + 1, vocab]; row j predicts tokens[j]
    taps: dict[int, torch.Tensor]
    tokens: list[int] = field(default_factory=list)  # to emit: accepted proposals, then the bonus token


class Speculator:
    """Speculative generation for one sequence at a time (batch row 0, like ``Engine.generate``).

    ``extra_token_cost``: the cost of one more verified token in decode steps (see
    :func:`choose_gamma`; ``bench_speculative`` measures it). ``drafter``: anything with
    DSpark's ``propose`` signature (the tests pass scripted doubles); default ``model.mtp``.
    """

    def __init__(self, model: Transformer, engine: Engine, *, extra_token_cost: float = 0.05, drafter=None):
        if drafter is None and not has_draft_stages(model):
            raise SpeculationUnavailable("this checkpoint has no DSpark draft stages (mtp.*); run without --speculative")
        a = model.args
        if not 0 <= a.dspark_noise_token_id < a.vocab_size or a.dspark_block_size < 1:
            raise SpeculationUnavailable(f"dspark_noise_token_id {a.dspark_noise_token_id} / dspark_block_size "
                                         f"{a.dspark_block_size} do not fit a vocabulary of {a.vocab_size}")
        self.model, self.engine, self.args = model, engine, a
        self.drafter = drafter if drafter is not None else model.mtp
        self.extra_token_cost = extra_token_cost
        self.context = DraftContext(a, model.device, spare=a.dspark_block_size + 1)
        self.stats = SpecStats()

    # ------------------------------------------------------------------ draft context
    @torch.no_grad()
    def sync(self, state: State, history: Sequence[int] | torch.Tensor) -> None:
        """Bring the draft context up to ``state.length`` from the tail of ``history`` (the ids
        the state covers; image spans are read as their placeholder ids): from the taps the
        prefill that ended there kept (``State.taps``) where they reach back far enough, else
        from a forward over the tail. Trusts a context of the same length: a stale or
        approximate context only costs acceptance."""
        ids, n, ctx = self.sync_tail(state, history), state.length, self.context
        kept, kept_end, state.taps = state.taps, state.taps_end, None  # the prefill's taps: used once, at most
        if ctx.length > n:
            ctx.truncate(n)
        start = n - ids.shape[1]
        if start == n:
            ctx.length = n
            return
        if kept_end == n and state.taps_start <= start:
            at = start - state.taps_start
            return self.drafter_extend({k: v[:, at:] for k, v in kept.items()}, start)
        self.drafter_extend(self._tail_taps(state.cache, ids.to(self.model.device), start), start)

    def sync_tail(self, state: State, history: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The ids [1, n - start] of ``history`` that :meth:`sync` runs: positions [start, n),
        from where the draft context (or the window) ends to ``state.length`` (none for a
        drafter without a context). Raises ValueError when ``history`` is shorter."""
        n = state.length
        start = max(min(self.context.length, n), n - self.args.sliding_window, 0) \
            if hasattr(self.drafter, "add_context") else n
        ids = torch.as_tensor(history, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] < n - start:
            raise ValueError(f"history has {ids.shape[1]} ids; the draft context needs the last {n - start}")
        return ids[:, ids.shape[1] - (n - start):]

    def drafter_extend(self, taps: dict[int, torch.Tensor], start: int) -> None:
        """Give the drafter the taps of positions [start, start + S) (drafters without a
        context, like the tests' scripted ones, only advance the length)."""
        self.context.truncate(start)
        add = getattr(self.drafter, "add_context", None)
        if add is None:
            self.context.length = start + next(iter(taps.values())).shape[1]
        else:
            add(self.context, taps, start, self.model.ropes)

    def _tail_taps(self, cache: Cache, ids: torch.Tensor, start: int) -> dict[int, torch.Tensor]:
        """Taps of positions the cache already covers, from a forward on a scratch view: the
        window rings and Engram look-back are copied; the global KV is shared read-only, since
        every source has consumed these positions and appends nothing. Approximate: a ring
        holds the newest window, so only the last positions see their whole window (on the
        default, taps 32-39% off the prefill's over a 128-token tail); the prefill's own taps
        (``State.taps``) are used instead wherever they reach back far enough."""
        view = copy.copy(cache)
        view.windows = [_ring_copy(r) for r in cache.windows]
        view.engram_ids, view.engram_pos = cache.engram_ids.clone(), cache.engram_pos.clone()
        streams, pre, step = decode_step.begin(self.model, ids, view, start)
        step.shared["taps"] = taps = {}
        decode_step.run_layers(self.model, streams, pre, step, view, range(max(self.args.dspark_target_layer_ids) + 1))
        return taps

    # ------------------------------------------------------------------ one round
    def propose(self, state: State, anchor: int, n: int, params: Sampling,
                generator: torch.Generator | None) -> DraftBlock:
        """The drafter's block after ``anchor`` at the end of ``state``: up to ``n`` proposals."""
        return self.drafter.propose(self.model, anchor, state.length, self.context, n, params, generator)

    def verify(self, state: State, ids: list[int]) -> _Round:
        """ONE target forward over [anchor, proposals...] at the end of ``state``: its logits
        [S, vocab] and taps; which tokens it emits is the caller's to choose."""
        m, cache = self.model, state.cache
        n, x = cache.length, torch.tensor([ids], device=m.device)
        streams, pre, step = decode_step.begin(m, x, cache, n)
        step.shared["taps"] = taps = {}
        streams, pre = decode_step.run_layers(m, streams, pre, step, cache, range(self.args.num_hidden_layers))
        cache.length = step.end
        return _Round(n, m.logits(streams, pre)[0], taps)

    def _round(self, state: State, anchor: int, params: Sampling, cap: int) -> _Round:
        gen = self._generator(state, params)
        block = self.propose(state, anchor, cap, params, gen) if cap > 0 else DraftBlock()
        gamma = choose_gamma(block.confidence, self.extra_token_cost, cap)
        proposals = block.tokens[:gamma]
        r = self.verify(state, [anchor] + proposals)
        if params.temperature <= 0:
            k, bonus = accept_greedy(proposals, r.logits)
        else:
            k, bonus = accept_sampled(block, gamma, r.logits, params, gen)
        s = self.stats
        s.forwards, s.drafted, s.accepted, s.emitted = s.forwards + 1, s.drafted + gamma, s.accepted + k, s.emitted + k + 1
        r.tokens = proposals[:k] + [bonus]
        return r

    def settle(self, state: State, r: _Round, fed: int) -> None:
        """Keep anchor + the first ``fed`` - 1 emitted tokens in the target and the draft context."""
        state.cache.truncate(r.n + fed)
        state.last_logits = r.logits[fed - 1: fed]
        self.drafter_extend({k: v[:, :fed] for k, v in r.taps.items()}, r.n)

    @staticmethod
    def _generator(state: State, params: Sampling) -> torch.Generator | None:
        if state.generator is None and params.seed is not None:
            state.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        return state.generator

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(self, state: State, params: Sampling, history: Sequence[int] | torch.Tensor) -> Iterator[int]:
        """``Engine.generate`` with speculation: the same ids (greedy) or the same distribution
        (sampling), and the same final state — the last yielded id is not fed, ``last_logits``
        predicted it. ``history``: the ids ``state`` covers (at least its last window)."""
        if state.cache.batch != 1:
            raise ValueError("speculative generation runs one sequence; use Engine.generate for batches")
        if params.max_new_tokens <= 0 or state.length >= self.engine.max_context:
            return
        token = int(self.engine.sample(state, params)[0])
        yield token
        emitted = 1
        if token not in params.stop_ids and emitted < params.max_new_tokens:
            self.sync(state, history)
        done = token in params.stop_ids or emitted >= params.max_new_tokens
        while not done:
            room, left = self.engine.max_context - state.length - 1, params.max_new_tokens - emitted - 1
            depth = state.cache.spare - 1  # rejected proposals must fit the cache's rollback room
            r = self._round(state, token, params, min(room, left, depth, self.args.dspark_block_size))
            emit, fed, done = self._cut(r, params, emitted)
            self.settle(state, r, fed)
            for j, token in enumerate(emit):
                try:
                    yield token
                except GeneratorExit:
                    self.settle(state, r, j + 1)
                    raise
            emitted += len(emit)

    def _cut(self, r: _Round, params: Sampling, emitted: int) -> tuple[list[int], int, bool]:
        """(ids to yield, tokens of the round to keep fed, finished): stop at a stop id, the
        token limit or the context limit exactly where ``Engine.generate`` would."""
        for j, token in enumerate(r.tokens):
            if r.n + 1 + j >= self.engine.max_context:
                return r.tokens[:j], j + 1, True
            if token in params.stop_ids or emitted + j + 1 >= params.max_new_tokens:
                return r.tokens[: j + 1], j + 1, True
        return r.tokens, len(r.tokens), False


def _ring_copy(ring: WindowRing) -> WindowRing:
    out = copy.copy(ring)
    out.data, out.pos = ring.data.clone(), ring.pos.clone()
    return out


def verify_pays(device) -> bool:
    """Whether speculation speeds decoding up on ``device``: a verify forward must cost about a
    decode step. On the CPU it does (1.22× a step, 2.51× the tokens/s: README). On CUDA a
    decode step is one CUDA graph of the fused kernels and a verify forward runs eagerly:
    50.8× a step on an H100 (2026-12-05, the default checkpoint), so speculation gave 0.18×
    the tokens/s — off there unless asked for."""
    return torch.device(device).type != "cuda"


def speculator_for(model: Transformer, engine: Engine, requested: bool | None = True, **kwargs) -> Speculator | None:
    """The CLI's switch: a Speculator when the checkpoint has draft stages and it is asked for
    (``requested`` True), or left to the device (None: where :func:`verify_pays`), else None.
    An engine over several ranks makes its own (``model.lockstep.Leader.speculator``: every
    rank makes its model calls)."""
    if requested is False or not has_draft_stages(model) or (requested is None and not verify_pays(model.device)):
        return None
    over_ranks = getattr(engine, "speculator", None)
    return Speculator(model, engine, **kwargs) if over_ranks is None else over_ranks(**kwargs)

