"""DSpark speculative decoding on `tiny`-family models with draft stages: checkpoint names,
greedy equality with plain decoding, exact rollback, and an unchanged sampling distribution.

How "exactly the same tokens" is made a sound test. Speculation verifies a block of tokens
in one target forward, plain decoding runs one token per forward, and the reference CPU
kernels are not batch-invariant: a GEMM with 1 row and one with 6 rows sum in different
orders (~1e-7), which the random model's FP8/FP4 rounding and top-k choices can turn into
a different token (measured: 1 flip in ~240 greedy tokens with rows of a block standing in
for decode steps). That is float noise, not the algorithm. So the equality tests run under
:class:`OrderInvariantMath`, a test double of batch-invariant kernels: every contraction,
reduction and transcendental is evaluated in float64 and rounded once to float32, so a
token row's result no longer depends on how many rows share its forward (checked in
``test_order_invariant_math_makes_rows_shape_independent``). Everything else — FP8/FP4
record bytes, top-k selection, the caches — is the production code. Under it speculative
greedy must equal plain greedy token for token, and the rolled-back cache must equal,
byte for byte, the cache of a run that only ever saw the accepted tokens.

The drafter with random weights almost never proposes the target's token, so acceptance
paths are also driven by :class:`ScriptedDrafter`, a test double that proposes the plain
greedy continuation with planted mistakes.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model.args import ModelArgs
from model.dspark import (DraftBlock, DSpark, SpeculationUnavailable, Speculator, accept_greedy, accept_sampled,
                          choose_gamma, shaped_probs, speculator_for)
from model.engine import Engine, Sampling
from model.loading import BUNDLED_TOKENIZER, _unbuilt_prefixes, bind_tokenizer, build

SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


def with_drafts(args: ModelArgs, **changes) -> ModelArgs:
    args = args.replace(**changes)
    return args.replace(num_nextn_predict_layers=3, compress_ratios=tuple(args.ratios) + (0, 0, 0))


TINY = with_drafts(ModelArgs.preset("tiny"), **SMALL)
# vocabulary 10 (> the noise id 7 and image id 8), no Engram or vision, 4 layers with a
# ratio-2 source and a ratio-1 decoder, 3 Sinkhorn rounds: cheap enough to draw hundreds of samples
MICRO = with_drafts(ModelArgs.preset("tiny"), **SMALL, vocab_size=10, engram_layer_ids=(), engram_num_embeddings=(),
                    vision=None, head_dim=128, num_hidden_layers=4, compress_ratios=(0, 2, 1, 1), hc_sinkhorn_iters=3,
                    kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2), candidate_source_layer_id=2,
                    dspark_target_layer_ids=(1, 2, 3))


def make(args: ModelArgs, seed: int = 1):
    model = build(args, seed=seed)
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two shared cores: one intra-op thread is ~30x faster here than two contending ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return make(TINY)


def ids_of(n: int, seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- test doubles

_EXACT_OPS = {F.linear, torch.einsum, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
              torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.softmax, torch.Tensor.softmax,
              F.softmax, torch.exp, torch.Tensor.exp, torch.sigmoid, torch.Tensor.sigmoid, torch.rsqrt,
              torch.Tensor.rsqrt, F.silu, F.softplus, torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin,
              torch.sqrt, torch.Tensor.sqrt, torch.cumsum, torch.Tensor.cumsum}


class OrderInvariantMath(TorchFunctionMode):
    """Test double of batch-invariant kernels: float32 contractions, reductions and
    transcendentals run in float64 and are rounded once, so their float32 results do not
    depend on summation order (i.e. on the batch shape). Elementwise + - * / are already
    correctly rounded; integer, quantisation and selection ops are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm:  # the grouped MoE path; it has no float64 kernel
            return _grouped_mm_double(*args, **kwargs)
        if func not in _EXACT_OPS:
            return func(*args, **kwargs)
        dtypes: set = set()
        _float_dtypes(args, dtypes)
        if not dtypes or dtypes == {torch.float64}:
            return func(*args, **kwargs)
        out = func(*_to_double(args), **kwargs)
        return out.to(torch.float32 if torch.float32 in dtypes else dtypes.pop())


def _grouped_mm_double(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as float64 matmuls of each group's rows, rounded once."""
    out, start = [], 0
    for group, end in enumerate(offs.tolist()):
        out.append(a[start:end].double() @ b[group].double())
        start = end
    return torch.cat(out).to(a.dtype)


def _float_dtypes(x, found: set) -> None:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        found.add(x.dtype)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _float_dtypes(y, found)


def _to_double(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_double(y) for y in x)
    return x


class ScriptedDrafter:
    """Test double of DSpark's ``propose``: the plain greedy continuation (``script``: absolute
    position -> token), wrong at every position divisible by ``every``; fixed confidences."""

    def __init__(self, script: dict[int, int], every: int, vocab: int):
        self.script, self.every, self.vocab = script, every, vocab
        self.confidence = [0.95, 0.9, 0.8, 0.7, 0.6]

    def propose(self, target, anchor, start, ctx, n, params, generator) -> DraftBlock:
        tokens = []
        for pos in range(start + 1, start + 1 + n):
            token = self.script.get(pos, 3)
            tokens.append((token + 1) % self.vocab if pos % self.every == 0 else token)
        return DraftBlock(tokens, [None] * n, self.confidence[:n])


# ----------------------------------------------------------------------------- helpers

def assert_same_cache(a, b) -> None:
    """Same readable state: window entries of the last ``sliding_window`` positions (bytes and
    slots), records, index keys, the pending group and the Engram look-back. Ring slots older
    than the window can differ: a verified block may overwrite them, and no query reads them."""
    assert a.length == b.length
    lo = a.length - a.args.sliding_window
    for i, (x, y) in enumerate(zip(a.windows, b.windows)):
        live = x.pos >= lo
        assert torch.equal(live, y.pos >= lo) and torch.equal(x.pos[live], y.pos[live]), f"layer {i} window"
        assert torch.equal(x.data[:, live], y.data[:, live]), f"layer {i} window bytes"
    for s, x in a.sources.items():
        y = b.sources[s]
        assert x.n == y.n, f"source {s} record count"
        assert torch.equal(x.view()[0], y.view()[0]) and torch.equal(x.view()[1], y.view()[1]), f"source {s} records"
        assert torch.equal(x.pending_kv, y.pending_kv) and torch.equal(x.pending_gate, y.pending_gate), f"pending {s}"
    live = a.engram_pos >= a.length - a.args.engram_max_ngram_size + 1
    assert torch.equal(live, b.engram_pos >= a.length - a.args.engram_max_ngram_size + 1)
    assert torch.equal(a.engram_pos[live], b.engram_pos[live])
    assert torch.equal(a.engram_ids[:, live], b.engram_ids[:, live])


def prefilled(engine: Engine, ids: torch.Tensor):
    state = engine.new_state()
    engine.prefill(state, ids)
    return state


# ----------------------------------------------------------------------------- (a) names

def test_draft_stage_names_and_shapes_follow_the_checkpoint(tiny):
    a, D, rank = TINY, TINY.hidden_size, TINY.dspark_markov_rank
    shapes = {k: tuple(v.shape) for k, v in tiny.state_dict().items() if k.startswith("mtp.")}
    assert isinstance(tiny.mtp, DSpark) and len(tiny.mtp) == 3
    assert shapes["mtp.0.main_proj.weight"] == (D, 3 * D) and shapes["mtp.0.main_norm.weight"] == (D,)
    assert shapes["mtp.2.norm.weight"] == (D,)
    assert shapes["mtp.2.markov_head.embed.weight"] == (a.vocab_size, rank)
    assert shapes["mtp.2.markov_head.head.weight"] == (a.vocab_size, rank)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, D + rank)
    backbone = {k.split(".", 2)[2] for k in tiny.state_dict() if k.startswith("layers.0.")}
    for k in range(3):
        stage = {n.split(".", 2)[2] for n in shapes if n.startswith(f"mtp.{k}.")}
        block = {n for n in stage if not n.startswith(("main_", "norm.", "markov_head.", "confidence_head."))}
        assert block == {n for n in backbone if not n.startswith("ffn.experts.") or int(n.split(".")[2]) < 4}
        assert {n.split(".")[2] for n in stage if n.startswith("ffn.experts.")} == {"0", "1", "2", "3"}
    assert not any("hc_head" in n or "compressor" in n or "indexer" in n for n in shapes)
    assert "mtp." not in _unbuilt_prefixes(tiny)
    assert "mtp." in _unbuilt_prefixes(make(ModelArgs.preset("tiny").replace(**SMALL)))


def test_speculation_is_unavailable_without_draft_stages():
    plain = make(ModelArgs.preset("tiny").replace(**SMALL))
    engine = Engine(plain)
    assert speculator_for(plain, engine) is None and not hasattr(plain, "mtp")
    with pytest.raises(SpeculationUnavailable, match="no DSpark draft stages"):
        Speculator(plain, engine)


def test_speculation_by_default_where_a_verify_costs_about_a_step(tiny, monkeypatch):
    """Left to the device (None), speculation is on where a verify forward costs about a decode
    step (the CPU) and off on CUDA, whose decode step is a CUDA graph and whose verify is eager;
    asked for, it is on anywhere; refused, off."""
    from model import dspark

    engine = Engine(tiny)
    assert dspark.verify_pays("cpu") and not dspark.verify_pays("cuda")
    assert isinstance(speculator_for(tiny, engine, requested=None), Speculator)
    assert speculator_for(tiny, engine, requested=False) is None
    monkeypatch.setattr(dspark, "verify_pays", lambda device: False)
    assert speculator_for(tiny, engine, requested=None) is None
    assert isinstance(speculator_for(tiny, engine, requested=True), Speculator)


# ----------------------------------------------------------------------------- (b) greedy

def test_order_invariant_math_makes_rows_shape_independent(tiny):
    """The premise of the equality tests: under the double, a block forward's rows equal
    single-token decode steps bit for bit (without it they differ by ~1e-6)."""
    engine = Engine(tiny, mode="exact", chunk=16)
    with OrderInvariantMath(), torch.no_grad():
        state = prefilled(engine, ids_of(23, seed=9))
        one, block = copy.deepcopy(state.cache), copy.deepcopy(state.cache)
        x = ids_of(6, seed=10)
        steps = torch.cat([tiny(x[:, i:i + 1], one) for i in range(6)], dim=1)
        assert torch.equal(steps, tiny(x, block))
        assert_same_cache(one, block)


PROMPTS = [(5, "exact"), (16, "ced"), (17, "exact"), (31, "ced"), (32, "exact"), (33, "ced"), (40, "exact"),
           (47, "ced")]  # chunk 16: lengths on and across chunk ends, odd and even for the ratio-2 sources


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_greedy_speculation_equals_plain_greedy(tiny, case):
    """24 tokens per prompt with a scripted draft that is accepted in part (every prompt) and
    with DSpark's own random-weight draft, rejected almost always (every other prompt, for
    time): the same ids, and the same final state (cache bytes, last logits)."""
    n, mode = PROMPTS[case]
    gen, engine, ids = 24, Engine(tiny, mode=mode, chunk=16), ids_of(n, seed=case)
    with OrderInvariantMath():
        plain_state = prefilled(engine, ids)
        plain = list(engine.generate(plain_state, Sampling(max_new_tokens=gen)))
        script = {n + j: t for j, t in enumerate(plain)}
        scripted = ScriptedDrafter(script, every=4 + case % 3, vocab=TINY.vocab_size)
        for drafter in (scripted, None)[: 2 - case % 2]:
            spec = Speculator(tiny, engine, drafter=drafter)
            state = prefilled(engine, ids)
            assert list(spec.generate(state, Sampling(max_new_tokens=gen), ids[0])) == plain
            assert torch.equal(state.last_logits, plain_state.last_logits)
            assert_same_cache(state.cache, plain_state.cache)
            if drafter is scripted:  # accepted in part, the planted mistakes rejected and rolled back
                assert 0 < spec.stats.accepted < spec.stats.drafted and spec.stats.forwards < gen - 1


def test_stop_ids_and_limits_leave_the_plain_state(tiny):
    """A stop id inside an accepted block, the token limit and the context limit end where
    Engine.generate ends: same ids, same cache length and last logits."""
    ids = ids_of(21, seed=11)
    with OrderInvariantMath():
        base = Engine(tiny, mode="exact", chunk=16)
        plain = list(base.generate(prefilled(base, ids), Sampling(max_new_tokens=20)))
        script = {21 + j: t for j, t in enumerate(plain)}
        cases = [(Sampling(max_new_tokens=20, stop_ids=(plain[7],)), None), (Sampling(max_new_tokens=9), None),
                 (Sampling(max_new_tokens=20), 33)]
        for params, max_context in cases:
            engine = Engine(tiny, mode="exact", chunk=16, max_context=max_context)
            a, b = prefilled(engine, ids), prefilled(engine, ids)
            want = list(engine.generate(a, params))
            got = list(Speculator(tiny, engine, drafter=ScriptedDrafter(script, 50, TINY.vocab_size))
                       .generate(b, params, ids[0]))
            assert got == want and a.length == b.length and torch.equal(a.last_logits, b.last_logits)
            assert_same_cache(a.cache, b.cache)


def test_closing_the_stream_mid_block_leaves_the_plain_state(tiny):
    """A consumer that stops reading after the 3rd id (inside an accepted block) finds the
    state Engine.generate leaves: 2 ids fed, last logits predicting the 3rd."""
    ids = ids_of(19, seed=12)
    with OrderInvariantMath():
        engine = Engine(tiny, mode="exact", chunk=16)
        plain = list(engine.generate(prefilled(engine, ids), Sampling(max_new_tokens=12)))
        a, b = prefilled(engine, ids), prefilled(engine, ids)
        want = list(itertools.islice(engine.generate(a, Sampling(max_new_tokens=12)), 3))
        spec = Speculator(tiny, engine, drafter=ScriptedDrafter({19 + j: t for j, t in enumerate(plain)}, 50, TINY.vocab_size))
        stream = spec.generate(b, Sampling(max_new_tokens=12), ids[0])
        got = list(itertools.islice(stream, 3))
        stream.close()
        assert spec.stats.accepted >= 2  # the 2nd and 3rd ids came from one verified block
        assert got == want and b.length == a.length == 21 and torch.equal(a.last_logits, b.last_logits)
        assert_same_cache(a.cache, b.cache)


# ----------------------------------------------------------------------------- (c) rollback

@pytest.mark.parametrize("n", [30, 31])
def test_verify_then_truncate_equals_a_cache_that_saw_only_the_accepted_tokens(tiny, n):
    """After one block of 6 through the target and a rollback to 1, 2 or 4 kept tokens, the
    cache is byte-identical to one fed only those tokens (odd and even n: the pending
    ratio-2 group is rebuilt from the projection history)."""
    engine = Engine(tiny, mode="ced", chunk=16)
    block = ids_of(6, seed=n)
    with OrderInvariantMath(), torch.no_grad():
        base = prefilled(engine, ids_of(n, seed=n + 1))
        for keep in (1, 2, 4):
            verified, reference = copy.deepcopy(base.cache), copy.deepcopy(base.cache)
            tiny(block, verified)
            verified.truncate(n + keep)
            tiny(block[:, :keep], reference)
            assert_same_cache(verified, reference)
            assert torch.equal(tiny(block[:, keep:keep + 2], verified), tiny(block[:, keep:keep + 2], reference))


def test_gamma_rule_and_greedy_acceptance():
    assert choose_gamma([0.9, 0.9, 0.9, 0.9, 0.9], 0.05, 5) == 5
    assert choose_gamma([0.9, 0.9, 0.9], 0.05, 2) == 2
    assert choose_gamma([0.05, 0.9, 0.9], 0.1, 3) == 1  # weak first proposal: verify one
    assert choose_gamma([0.9, 0.1, 0.9, 0.9], 0.2, 4) == 1
    assert choose_gamma([0.9, 0.9], 0.05, 0) == 0
    logits = torch.eye(5)[[2, 4, 1, 0]]  # argmax 2, 4, 1, 0
    assert accept_greedy([2, 4, 3], logits) == (2, 1)
    assert accept_greedy([2, 4, 1], logits) == (3, 0)
    assert accept_greedy([], logits) == (0, 2)


# ----------------------------------------------------------------------------- (d) sampling

def exact_distributions(model, ids: torch.Tensor, params: Sampling, steps: int) -> list[torch.Tensor]:
    """Plain sampling's exact marginals of the first ``steps`` tokens, by enumerating every
    prefix as a batch row: [P(t0), P(t1), ...], each [vocab]."""
    V = model.args.vocab_size
    engine, joint, marginals = Engine(model, mode="exact"), torch.ones(1), []
    for t in range(steps):
        rows = V ** t
        state = engine.new_state(batch=rows)
        logits = engine.prefill(state, ids.expand(rows, -1))
        for i in range(t):  # the i-th token of row r is digit i of r in base V
            logits = engine.decode(state, torch.arange(rows) // V ** (t - 1 - i) % V)
        step = joint[:, None] * shaped_probs(logits, params).double()  # [rows, V]
        marginals.append(step.sum(0))
        joint = step.flatten()
    return marginals


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of counts against probs, cells with expectation < 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def test_rejection_sampling_emits_the_target_distribution():
    """accept_sampled alone, 20000 draws on 6 tokens: whatever the draft q, the first emitted
    token follows p (this also catches a residual drawn from p instead of max(0, p - q))."""
    g = torch.Generator().manual_seed(0)
    logits, params = torch.randn(3, 6, generator=g) * 1.5, Sampling(temperature=1.0)
    q = [torch.randn(6, generator=g).mul(1.5).softmax(-1) for _ in range(2)]
    counts = torch.zeros(6)
    for _ in range(20000):
        tokens = [int(torch.multinomial(x, 1, generator=g)) for x in q]
        k, bonus = accept_sampled(DraftBlock(tokens, q, [1.0, 1.0]), 2, logits, params, g)
        counts[tokens[0] if k >= 1 else bonus] += 1
    p = shaped_probs(logits[0], params).double()
    assert chi2_pvalue(counts, p) > 1e-3 and (counts / counts.sum() - p).abs().sum() < 0.03


def test_sampling_distribution_is_unchanged():
    """On a 10-token vocabulary: the first 4 sampled ids of 300 seeded speculative runs (the
    DSpark drafter, every proposal verified) follow plain sampling's exact marginals."""
    model, steps, runs = make(MICRO, seed=3), 4, 300
    params = Sampling(temperature=0.9, top_k=8, max_new_tokens=steps)
    prompt = ids_of(6, seed=4, vocab=10)
    exact = exact_distributions(model, prompt, params, steps)
    engine = Engine(model, mode="exact")
    spec = Speculator(model, engine, extra_token_cost=0.0)
    base = prefilled(engine, prompt)
    spec.sync(base, prompt[0])
    context, counts = copy.deepcopy(spec.context), torch.zeros(steps, 10)
    for seed in range(runs):
        state, spec.context = copy.deepcopy(base), copy.deepcopy(context)
        out = list(spec.generate(state, Sampling(**{**params.__dict__, "seed": seed}), prompt[0]))
        counts[torch.arange(steps), torch.tensor(out)] += 1
    s = spec.stats
    assert 0 < s.accepted < s.drafted  # both acceptance and rejection were exercised
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(steps)]
    assert min(pvalues) > 1e-3, pvalues


def test_agent_switch_uses_the_speculator_only_when_asked(tiny, tmp_path):
    from dsagent.agent import Agent, AgentOptions
    from dsagent.runtime import Runtime
    from model.dspark import Speculator
    from model.tokenizer import Tokenizer
    from sessions import Store

    rt = Runtime(tiny, Tokenizer.bundled(), Engine(tiny), fingerprint="test", source="tiny+drafts")
    with Store.open(tmp_path) as store:
        opts = dict(tools=[], workspace=tmp_path, sampling=Sampling(max_new_tokens=3))
        off = Agent(rt, store, AgentOptions(session="off", speculative=False, **opts))
        assert off.speculator is None
        with Agent(rt, store, AgentOptions(session="on", **opts)) as on:
            assert isinstance(on.speculator, Speculator)
            result = on.turn("hi")
        assert on.speculator.stats.forwards >= 1 and result.usage.completion_tokens <= 3


@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_prefill_keeps_the_taps_the_draft_context_is_made_from(tiny, mode):
    """A prefill keeps the target layers' taps of its last positions (CED: the decoder's
    replayed window), and the speculator makes its context from them once, instead of a
    forward over the tail: the same entries but for float rounding of FP8 codes."""
    engine = Engine(tiny, mode=mode, chunk=36)  # exact: the last chunk shorter than the window
    state, n, window = engine.new_state(), 40, tiny.args.sliding_window
    ids = ids_of(n, seed=3)
    engine.prefill(state, ids)
    width = n - state.taps_start
    assert set(state.taps) == set(tiny.args.dspark_target_layer_ids) and width >= window
    assert all(t.shape[1] == width for t in state.taps.values())
    tailed = copy.deepcopy(state)
    tailed.taps = None  # the other way: a forward over the tail
    kept, other = Speculator(tiny, engine), Speculator(tiny, engine)
    kept.sync(state, ids[0])
    other.sync(tailed, ids[0])
    assert state.taps is None and kept.context.length == other.context.length == n
    for a, b in zip(kept.context.rings, other.context.rings):
        (x, xp), (y, yp) = a.read(), b.read()
        assert torch.equal(xp, yp) and (xp >= n - window).sum() == window
        assert (x - y).abs().mean() <= 0.01 * y.abs().mean()
    engine.decode(state, torch.tensor([5]))
    assert state.taps is None  # taps are of the prefill that ended where the state ends
