"""Training the DSpark draft stages of a trained model, the backbone frozen (DeepSpec's recipe).

Owns:
- **draft stages on a trained model** (:func:`add_draft_stages`): ``mtp.0..K-1`` seeded and
  attached, the config told, every backbone parameter frozen;
- **self-distilled samples** (:func:`self_distilled`): a tokenised conversation run as the
  runtime runs it, each assistant reply replaced by the model's own greedy reply, with what
  the drafter trains on kept per reply (:class:`DraftSample`): the ids, the taps of the
  target layers (the drafter's context), and the target's logits over the reply;
- **the training forward** (:func:`draft_losses`): blocks [anchor, noise...] at random
  reply positions, each seeing the context entries of the ``sliding_window`` positions
  before its anchor — the same draft forward that decoding runs (``DSpark.hidden_rows``),
  many blocks at once through :class:`BlockWindows`; the losses of DeepSpec's DSpark: the
  cross-entropy on the target's greedy tokens and the L1 distance to the target's
  distribution, both weighted exp(-i / gamma) along the block, and the confidence head's
  binary cross-entropy to the acceptance probability 1 - TV(draft, target).

The greedy acceptance is read off the same forward: proposal i is accepted when every
proposal before it was and its argmax (through the Markov head, fed the accepted tokens)
is the target's token, so ``accepted`` counts what greedy speculation would accept with
blocks verified whole. Does not own the draft network (``model.dspark``), the corpus or
the optimiser loop (``scripts/train_default.py``).
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import decode_step
from model.cache import Cache
from model.dspark import DSpark, fp8_entries
from model.layer import Step
from model.loading import init_weights
from model.model import Transformer
from model.training import Example


# ----------------------------------------------------------------------------- the stages

def add_draft_stages(model: Transformer, seed: int, stages: int = 3, replace: bool = False) -> Transformer:
    """Attach ``stages`` seeded draft stages to ``model`` and freeze the rest; a model that has
    stages already is refused, or with ``replace`` given new ones. The Markov head's output
    and the confidence projection start at zero: the first drafts are the target head's
    reading of the stages' hidden, every confidence one half."""
    if getattr(model, "mtp", None) is not None:
        if not replace:
            raise ValueError("this model already has draft stages")
        del model.mtp
    a = model.args
    ratios = tuple(a.compress_ratios[:a.num_hidden_layers]) + (0,) * stages
    model.args = a.replace(num_nextn_predict_layers=stages, compress_ratios=ratios)
    for p in model.parameters():
        p.requires_grad_(False)
    mtp = DSpark(model.args).to(device=model.device, dtype=model.embed.weight.dtype)
    with torch.no_grad():
        init_weights(mtp, seed, prefix="mtp.", device=model.device)
        mtp[-1].markov_head.head.weight.zero_()
        mtp[-1].confidence_head.proj.weight.zero_()
    model.mtp = mtp
    model.derived.clear()
    return model


def draft_parameters(model: Transformer) -> list[torch.nn.Parameter]:
    """The trainable parameters: the draft stages' (the routers' biases are set by the balance)."""
    return [p for n, p in model.mtp.named_parameters() if not n.endswith(("gate.bias", "gate.bias_vl"))]


# ----------------------------------------------------------------------------- samples

@dataclass
class DraftSample:
    """One assistant reply that is the model's own greedy output, with its context.

    Positions are the conversation's, from ``start``: ``ids`` [L] cover [start, start + L),
    the reply [start + reply, start + L) (its last id the stop id, or the cut-off token);
    ``taps`` [L - 1, n_taps, D] the target layers' taps of [start, start + L - 1);
    ``logits`` [L - reply, vocab] the target's logits that predict each reply id."""
    ids: torch.Tensor
    start: int
    reply: int
    taps: torch.Tensor
    logits: torch.Tensor

    @property
    def anchors(self) -> range:
        """Positions (in ``ids``) a block may start from: a reply id followed by one."""
        return range(self.reply, len(self.ids) - 1)


class _Run:
    """A conversation fed through the model one piece at a time, keeping every position's
    taps and the logits of the last one."""

    def __init__(self, model: Transformer, cache: Cache, ids: list[int], taps: list[torch.Tensor],
                 last: torch.Tensor | None):
        self.model, self.cache, self.ids, self.taps, self.last = model, cache, ids, taps, last
        self.layers = model.args.dspark_target_layer_ids

    def feed(self, ids: list[int], image_embeds=None, image_mask=None, chunk: int = 1024) -> torch.Tensor:
        """Run ``ids``; returns their logits [len(ids), vocab] (row j predicts the id after ids[j])."""
        out = []
        for at in range(0, len(ids), chunk):
            x = torch.tensor([ids[at: at + chunk]], device=self.model.device)
            emb = None if image_embeds is None else image_embeds[:, at: at + chunk]
            img = None if image_mask is None else image_mask[:, at: at + chunk]
            streams, pre, step = decode_step.begin(self.model, x, self.cache, self.cache.length,
                                                   image_embeds=emb, image_mask=img)
            step.shared["taps"] = taps = {}
            streams, pre = decode_step.run_layers(self.model, streams, pre, step, self.cache,
                                                  range(self.model.args.num_hidden_layers))
            self.cache.length = step.end
            self.taps.append(torch.stack([taps[layer][0] for layer in self.layers], dim=1))
            out.append(self.model.logits(streams, pre)[0])
        self.ids += ids
        logits = torch.cat(out)
        self.last = logits[-1]
        return logits

    def fork(self) -> "_Run":
        return _Run(self.model, copy.deepcopy(self.cache), list(self.ids), list(self.taps), self.last)


def prefix_run(model: Transformer, ids: list[int]) -> _Run:
    """The model run over a prefix every conversation shares (the system prompt), to fork from."""
    run = _Run(model, model.new_cache(1), [], [], None)
    with torch.no_grad():
        run.feed(list(ids))
    return run


def reply_spans(trained) -> list[tuple[int, int]]:
    """[start, end) of each run of trained (assistant) ids."""
    spans, start = [], None
    for i, t in enumerate(list(trained) + [False]):
        if t and start is None:
            start = i
        elif not t and start is not None:
            spans.append((start, i))
            start = None
    return spans


@torch.no_grad()
def self_distilled(model: Transformer, ex: Example, *, prefix: _Run | None = None, stop_ids=(),
                   extra: int = 16) -> tuple[list[DraftSample], dict]:
    """``ex`` run through ``model`` (exact prefill, as the runtime's decode path computes it)
    with every assistant reply replaced by the model's greedy reply to what came before
    (the conversation's later turns follow as written); a reply is generated until a stop id
    or ``extra`` ids past the written one's length. ``prefix``: a run of the first ids every
    conversation shares (:func:`prefix_run`), forked rather than run again when ``ex`` starts
    with it. Returns the samples, one a reply, and counts: replies, those kept as written
    (the model's greedy reply already), ids generated."""
    ids = [int(t) for t in ex.ids]
    window = model.args.sliding_window
    stop = set(stop_ids) or {model.args.eos_token_id}
    if prefix is not None and ids[:len(prefix.ids)] == prefix.ids:
        run = prefix.fork()
    else:
        run = _Run(model, model.new_cache(1), [], [], None)
    embeds = _image_embeds(model, ex)
    at, samples, counts = len(run.ids), [], {"replies": 0, "as_written": 0, "generated": 0}

    def feed_written(lo: int, hi: int) -> torch.Tensor | None:
        if hi <= lo:
            return None
        emb = img = None
        if embeds is not None and embeds[1][lo:hi].any():
            emb, img = embeds[0][None, lo:hi], embeds[1][None, lo:hi]
        return run.feed(ids[lo:hi], emb, img)

    for s, e in reply_spans(ex.trained):
        if s < at:
            raise ValueError("a reply inside the shared prefix")
        feed_written(at, s)
        begin, first = len(run.ids), run.last  # where the reply starts in the new conversation
        snapshot = run.fork()
        written = run.feed(ids[s:e])
        greedy = torch.cat([first[None], written[:-1]]).argmax(-1).tolist()
        miss = next((j for j, t in enumerate(ids[s:e]) if greedy[j] != t), None)
        counts["replies"] += 1
        rows = torch.cat([first[None], written[:-1]])
        if miss is None:
            counts["as_written"] += 1
        else:
            run = snapshot
            rows = [first[None]]
            if miss:
                rows.append(run.feed(ids[s:s + miss]))
            token, n = greedy[miss], miss
            while True:
                n += 1
                counts["generated"] += 1
                if token in stop or n >= (e - s) + extra:
                    run.ids.append(token)  # the reply's last id: predicted, never fed
                    break
                rows.append(run.feed([token]))
                token = int(run.last.argmax())
            rows = torch.cat(rows)[:n]
        end = len(run.ids)
        lo = max(0, begin - window)
        taps = torch.cat(run.taps)[lo:end - 1].clone()  # its own storage, not the conversation's
        samples.append(DraftSample(torch.tensor(run.ids[lo:end]), lo, begin - lo, taps, rows.float()))
        if miss is not None:  # the reply's last id was never fed: the next turn follows it
            run.feed([run.ids.pop()])
        at = e
    return samples, counts


def _image_embeds(model: Transformer, ex: Example):
    """(embeddings [T, D], mask [T]) of the image spans of ``ex`` at their positions, or None."""
    if not ex.images:
        return None
    T, D = len(ex.ids), model.args.hidden_size
    emb = torch.zeros(T, D, dtype=model.embed.weight.dtype, device=model.device)
    mask = torch.zeros(T, dtype=torch.bool, device=model.device)
    for start, image in ex.images:
        span = model.encode_image(image)
        emb[start:start + span.shape[0]] = span
        mask[start:start + span.shape[0]] = True
    return emb, mask


# ----------------------------------------------------------------------------- the training forward

class BlockWindows:
    """The draft context of N blocks at once, for ``DraftAttention.forward``: every sample's
    context features c (with their gradient), each stage's entries made from them at their
    positions as decoding makes them, and for each block the ``sliding_window`` entries
    before its anchor."""

    def __init__(self, mtp: DSpark, samples: list[DraftSample], anchors: list[list[int]]):
        W, S = mtp.args.sliding_window, mtp.args.dspark_block_size
        device = mtp[0].main_proj.weight.device
        taps = torch.cat([s.taps for s in samples]).to(device)  # [sum L, n_taps, D]
        layers = mtp.args.dspark_target_layer_ids
        self.c = mtp.context({layer: taps[None, :, k] for k, layer in enumerate(layers)})
        self.positions = torch.cat([s.start + torch.arange(len(s.taps)) for s in samples]).to(device)
        index, block_pos, offset = [], [], 0
        for s, mine in zip(samples, anchors):
            for a in mine:  # a: the anchor's index in s.ids; entries of positions [a - W, a)
                index.append(offset + torch.arange(a - W, a) if a >= W else
                             torch.cat([torch.full((W - a,), -1), offset + torch.arange(a)]))
                block_pos.append(s.start + a + torch.arange(S))
            offset += len(s.taps)
        self.index = torch.stack(index).to(device)
        self.seen = self.index >= 0
        self.block_positions = torch.stack(block_pos).to(device)

    def window(self, attn, step: Step, ropes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        entries = fp8_entries(attn.context_kv(self.c, self.positions, ropes))[0]
        return entries[self.index.clamp_min(0)], self.seen, self.block_positions


@dataclass
class DraftLosses:
    total: torch.Tensor
    ce: float
    l1: float
    confidence: float
    blocks: int
    accepted: float  # greedy proposals accepted, summed over the blocks
    confidence_mean: float  # mean predicted confidence over the supervised proposals
    accept_rate: float  # mean 1 - TV over the supervised proposals


def pick_anchors(samples: list[DraftSample], per_sample: int, rng: random.Random) -> list[list[int]]:
    """Up to ``per_sample`` anchors of each sample, drawn without replacement, in order."""
    return [sorted(rng.sample(list(s.anchors), min(per_sample, len(s.anchors)))) for s in samples]


def draft_losses(model: Transformer, samples: list[DraftSample], anchors: list[list[int]], *,
                 ce_weight: float = 0.1, l1_weight: float = 0.9, confidence_weight: float = 1.0,
                 decay: float = 4.0) -> DraftLosses:
    """DeepSpec's DSpark losses on the blocks at ``anchors`` (indices into each sample's ids)."""
    mtp, S = model.mtp, model.args.dspark_block_size
    device = model.device
    windows = BlockWindows(mtp, samples, anchors)
    anchor_ids, labels, valid, targets = [], [], [], []
    for s, mine in zip(samples, anchors):
        L = len(s.ids)
        for a in mine:
            at = a + 1 + torch.arange(S)  # the ids block position i proposes
            ok = at < L
            anchor_ids.append(s.ids[a])
            labels.append(torch.where(ok, s.ids[at.clamp(max=L - 1)], 0))
            valid.append(ok)
            targets.append(s.logits[(at - s.reply).clamp(max=L - 1 - s.reply)])  # row r predicts reply id r
    anchor_ids = torch.stack(anchor_ids).to(device)
    labels, valid = torch.stack(labels).to(device), torch.stack(valid).to(device)
    targets = torch.stack(targets).to(device)  # [N, S, vocab]
    h = mtp.hidden_rows(model, anchor_ids, Step(start=0, length=S), windows)  # [N, S, D]
    last = mtp[-1]
    prev = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)
    logits = model.head(h).float() + last.markov_head(prev)
    conf_logit = last.confidence_head.logit(h, last.markov_head.embed(prev))
    weight = valid.float() * torch.exp(-torch.arange(S, device=device) / decay)
    norm = weight.sum().clamp_min(1e-6)
    ce = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(weight) * weight).sum() / norm
    p, q = logits.softmax(-1), targets.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    l1 = (2 * tv * weight).sum() / norm
    accept = (1 - tv).detach().clamp(0, 1)
    conf = (F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none") * weight).sum() / norm
    total = ce_weight * ce + l1_weight * l1 + confidence_weight * conf
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
        accepted = float(hit.int().cumprod(-1).sum())
        n = valid.sum().clamp_min(1)
        conf_mean = float((torch.sigmoid(conf_logit) * valid).sum() / n)
        rate = float((accept * valid).sum() / n)
    return DraftLosses(total, float(ce.detach()), float(l1.detach()), float(conf.detach()), len(anchor_ids), accepted,
                       conf_mean, rate)
