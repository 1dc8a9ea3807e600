"""Training the V4.1 network as it is served: QAT weights, QAT KV, simulated bounded replay.

Owns, for a batch of tokenised conversations:
- **QAT weights**: every weight the checkpoint stores as FP8 or FP4 is seen by the forward
  pass exactly as ``read_checkpoint`` will return it (straight-through gradients), so
  writing the trained model loses nothing (:func:`add_weight_qat`, :func:`remove_weight_qat`).
- **QAT KV**: the cache holds ``KVFormat.TRAIN`` floats, the same values the packed
  FP8 window / FP4 record / FP4 index layouts give at inference.
- **Bounded replay** (ARCHITECTURE.md §2.7, RUNTIME.md §4), per row: ``exact`` (every
  token through every layer); ``ced`` (the decoder's windows start 128 tokens before an
  assistant reply, as CED prefill replays only the prompt's last window through the
  decoder); ``resume`` (the encoder's windows also start a window before an earlier turn
  boundary, as a resume from disk replays only the last window). Loss is taken only on
  trained tokens the simulated runtime would really produce.
- **Losses**: next-token cross-entropy on trained (assistant) tokens, and the indexer's
  KL to its layer's dense attention (the indexer learns from that loss alone).
- **Router balance**: the aux-loss-free bias update from the expert loads of a step.

The forward pass is the inference code path itself (``Transformer.begin`` /
``run_layers`` over chunks of a shared cache), so training and serving cannot drift.
A common prefix of the batch (the long system prompt every record starts with) runs once
on one row and is then shared by every row. Does not own the corpus (``dsagent.corpus``),
the optimiser loop or checkpoints (``scripts/train_default.py``).
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from model import kernels
from model.cache import Cache
from model.checkpoint import DEFAULT_BLOCK, fp8_block_shape, stored_format, write_checkpoint
from model.loading import BUNDLED_TOKENIZER
from model.model import Transformer
from model.moe import MoE
from model.quant import KVFormat, fake_quant_fp8_weight, straight_through
from model.vision import image_inputs

REPLAY_MODES = ("exact", "ced", "resume")


# ----------------------------------------------------------------------------- QAT weights

class _WeightQAT(nn.Module):
    def __init__(self, fmt: str, block: tuple[int, int]):
        super().__init__()
        self.fmt, self.block = fmt, block
        self.ready: tuple[int, torch.Tensor] | None = None  # (the weight's address, its value): see quantised_weights

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.ready is not None and self.ready[0] == w.data_ptr():
            return straight_through(w, self.ready[1])
        with torch.no_grad():  # the straight-through gradient needs q's values only: no graph for them
            q = self.values(w)
        return straight_through(w, q)

    def values(self, w: torch.Tensor) -> torch.Tensor:
        """What the checkpoint stores of ``w`` [..., out, in] (leading dims: a stack of weights)."""
        if self.fmt == "fp8":
            return fake_quant_fp8_weight(w, self.block)
        if self.fmt == "fp4":  # one kernel launch on CUDA, bit-exact with the twin
            in_f, block = w.shape[-1], self.block[1]
            return kernels.fake_quant_fp4(F.pad(w.float(), (0, -in_f % block)), block)[..., :in_f].to(w.dtype)
        return w.to(torch.bfloat16).to(w.dtype)  # bf16 storage


@contextmanager
def quantised_weights(model: nn.Module):
    """One training step's QAT weights: ``parametrize.cached()``, with every weight's stored
    value computed on entry, stacked by format and shape — a few dozen launches where one
    weight at a time took ~2,700 a step (``tiny`` on CUDA). The values are dropped on exit:
    the weights must not change inside (an optimiser step goes after it)."""
    groups: dict[tuple, list[tuple[_WeightQAT, torch.Tensor]]] = {}
    for module in model.modules():
        for attr, chain in (module.parametrizations.items() if parametrize.is_parametrized(module) else ()):
            if isinstance(chain[0], _WeightQAT):
                w = chain.original
                groups.setdefault((chain[0].fmt, chain[0].block, tuple(w.shape), w.dtype, w.device), []).append(
                    (chain[0], w))
    with parametrize.cached():
        try:
            with torch.no_grad():
                for items in groups.values():
                    stacked = items[0][0].values(torch.stack([w for _, w in items]))
                    for (qat, w), q in zip(items, stacked.unbind(0)):
                        qat.ready = (w.data_ptr(), q)
            yield
        finally:
            for items in groups.values():
                for qat, _ in items:
                    qat.ready = None


def add_weight_qat(model: Transformer, expert_dtype: str = "fp4", block: int = DEFAULT_BLOCK, only: str = "") -> int:
    """Make every stored-as-FP8/FP4/BF16 parameter read as its checkpoint value (``only``: those
    whose names start so, e.g. the draft stages' ``mtp.``); returns how many."""
    n = 0
    for name, p in list(model.named_parameters()):
        if not name.startswith(only):
            continue
        fmt = stored_format(name, tuple(p.shape), expert_dtype)
        if fmt == "f32":
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        blk = fp8_block_shape(name, block) if fmt == "fp8" else (1, block)
        parametrize.register_parametrization(module, attr, _WeightQAT(fmt, blk))
        n += 1
    return n


def remove_weight_qat(model: Transformer) -> None:
    """Back to plain parameters holding the trained (unquantised) values."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for attr in list(module.parametrizations):
                parametrize.remove_parametrizations(module, attr, leave_parametrized=False)


def write_trained(model: Transformer, out) -> None:
    """The trained ``model`` as an official checkpoint in ``out`` (new or empty) with the
    tokenizer it was loaded with (``load`` records it; else the bundled one): QAT removed
    first, so the stored values are the ones it trained with."""
    remove_weight_qat(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tokenizer_json = getattr(model, "tokenizer_json", None) or BUNDLED_TOKENIZER
    write_checkpoint(out, model.args.to_config(), state, tokenizer_json=tokenizer_json)


def official_name(name: str) -> str:
    """A state-dict name, with or without QAT registered -> the official checkpoint name."""
    return name.replace("parametrizations.", "").replace(".original", "")


def plain_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict under official names, with or without QAT registered."""
    return {official_name(name): t for name, t in model.state_dict().items()}


# ----------------------------------------------------------------------------- examples and batches

@dataclass
class Example:
    """One tokenised conversation, images already expanded to spans of image tokens."""
    ids: list[int]
    trained: list[bool]  # per id: an assistant token the loss is taken on
    images: list[tuple[int, object]] = field(default_factory=list)  # (span start, decoded PIL image)
    replies: list[int] = field(default_factory=list)  # where each assistant reply starts
    prompts: list[int] = field(default_factory=list)  # where each prompt after a reply starts
    weight: float = 1.0  # how many times its trained tokens count in a batch's loss

    def __post_init__(self) -> None:
        if not self.replies or not self.prompts:  # the mask's rising and falling edges
            steps = np.diff(np.asarray(self.trained, dtype=np.int8), prepend=0)
            self.replies = self.replies or np.flatnonzero(steps == 1).tolist()
            self.prompts = self.prompts or np.flatnonzero(steps == -1).tolist()


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool: the id at t is predicted (from t - 1) and trained
    floor: torch.Tensor  # [B, L] long: the first window position per row and layer (-1 = none)
    images: list[tuple[int, int, object]]  # (row, span start, PIL image)
    modes: list[str]
    weights: torch.Tensor | None = None  # [B] float: each row's Example.weight (None: all 1)

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_mask.sum())


def choose_replay(ex: Example, mode: str, window: int, decoder_start: int, layers: int,
                  rng: random.Random) -> tuple[list[int], int]:
    """(window floor per layer, first position whose prediction is trained) for one row."""
    floor = [-1] * layers
    if mode == "exact" or not ex.replies:
        return floor, 0
    reply = rng.choice(ex.replies)
    if mode == "resume":
        earlier = [p for p in ex.prompts if p < reply]
        if earlier:
            resumed = rng.choice(earlier)
            floor[:decoder_start] = [max(0, resumed - window)] * decoder_start
    floor[decoder_start:] = [max(0, reply - window)] * (layers - decoder_start)
    return floor, reply


def make_batch(examples: list[Example], modes: list[str], *, window: int, decoder_start: int, layers: int,
               pad_id: int, rng: random.Random) -> Batch:
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    floors, images = [], []
    for b, (ex, mode) in enumerate(zip(examples, modes)):
        ids[b, : len(ex.ids)] = torch.tensor(ex.ids)
        floor, first = choose_replay(ex, mode, window, decoder_start, layers, rng)
        floors.append(floor)
        trained = torch.tensor(ex.trained)
        trained[:max(first, 1)] = False  # position 0 has no prediction
        mask[b, : len(ex.ids)] = trained
        images += [(b, start, img) for start, img in ex.images]
    weights = [ex.weight for ex in examples]
    return Batch(ids, mask, torch.tensor(floors, dtype=torch.long), images, list(modes),
                 None if all(w == 1.0 for w in weights) else torch.tensor(weights, dtype=torch.float32))


def batch_for(args, examples: list[Example], modes: list[str], rng: random.Random) -> Batch:
    """:func:`make_batch` with the window, decoder start, layer count and pad id of the
    model's ``args`` (``ModelArgs``)."""
    return make_batch(examples, modes, window=args.sliding_window, decoder_start=args.decoder_start,
                      layers=args.num_hidden_layers, pad_id=args.pad_token_id, rng=rng)


def common_prefix(batch: Batch, multiple: int = 1) -> int:
    """Positions every row shares: same ids, no image, no floor and no trained prediction inside."""
    ids = batch.ids
    same = (ids == ids[:1]).all(0)
    n = int(same.long().cumprod(0).sum()) if len(same) else 0
    trained = batch.loss_mask.any(0).nonzero()
    if trained.numel():
        n = min(n, int(trained[0]) - 1)
    floors = batch.floor[batch.floor >= 0]
    if floors.numel():
        n = min(n, int(floors.min()))
    for _, start, _ in batch.images:
        n = min(n, start)
    n = min(n, ids.shape[1] - 1)
    return max(0, n // multiple * multiple)


# ----------------------------------------------------------------------------- the forward pass

@dataclass
class StepLosses:
    lm: torch.Tensor
    index: torch.Tensor
    tokens: int
    correct: int

    @property
    def total(self) -> torch.Tensor:
        return self.lm + self.index


def batch_loss(model: Transformer, batch: Batch, *, chunk: int = 1024, dense: bool = False,
               kv: KVFormat = KVFormat.TRAIN, share_prefix: bool = True,
               prefix_chunk: int | None = None) -> StepLosses:
    """Cross-entropy on the batch's trained tokens plus the indexer KL, through the serving code
    path, in chunks of ``chunk`` tokens (``prefix_chunk`` for the shared one-row prefix). A row of
    ``batch.weights`` w counts its tokens' cross-entropy w times in the sum that the trained
    token count divides."""
    device = model.device
    ids, mask = batch.ids.to(device), batch.loss_mask.to(device)
    weights = None if batch.weights is None else batch.weights.to(device)
    B, T = ids.shape
    embeds, image_mask = _image_embeds(model, batch, ids)
    prefix = common_prefix(batch) if share_prefix else 0
    cache = Cache(model.args, batch=1, device=device, kv=kv)
    index_losses: list[torch.Tensor] = []
    ce_sum = torch.zeros((), device=device)
    correct = 0
    start = 0
    for end in _chunk_ends(prefix, T, chunk, prefix_chunk or chunk):
        if start == prefix and cache.batch == 1 and B > 1:
            cache = repeat_rows(cache, B)
        rows = slice(0, 1) if start < prefix else slice(None)
        part = slice(start, end)
        emb = None if embeds is None else embeds[rows, part]
        img = None if image_mask is None else image_mask[rows, part]
        streams, pre, step = model.begin(ids[rows, part], cache, start, image_embeds=emb, image_mask=img)
        step.floor = None if start < prefix else batch.floor.to(device)  # the prefix lies below every floor
        step.index_losses, step.dense = index_losses, dense
        streams, pre = model.run_layers(streams, pre, step, cache, range(model.args.num_hidden_layers))
        cache.length = end
        # the logits at t predict the id at t + 1
        tgt = ids[rows, start + 1: end + 1]
        sel = mask[rows, start + 1: end + 1]
        n = tgt.shape[1]
        if sel[:, :n].any():
            hidden = model.final_hidden(streams[:, :n], pre[:, :n])[sel[:, :n]]
            logits = model.head(hidden).float()
            if weights is None:
                ce_sum = ce_sum + F.cross_entropy(logits, tgt[sel[:, :n]], reduction="sum")
            else:
                per_row = weights[rows, None].expand(-1, n)[sel[:, :n]]
                ce_sum = ce_sum + (F.cross_entropy(logits, tgt[sel[:, :n]], reduction="none") * per_row).sum()
            correct += int((logits.argmax(-1) == tgt[sel[:, :n]]).sum())
        start = end
    tokens = int(mask.sum())
    lm = ce_sum / max(tokens, 1)
    index = torch.stack(index_losses).mean() if index_losses else torch.zeros((), device=device)
    return StepLosses(lm, index, tokens, correct)


def _chunk_ends(prefix: int, total: int, chunk: int, prefix_chunk: int) -> list[int]:
    ends = list(range(prefix_chunk, prefix, prefix_chunk)) + ([prefix] if prefix else [])
    last = prefix
    while last < total:
        last = min(total, last + chunk)
        ends.append(last)
    return ends


def _image_embeds(model: Transformer, batch: Batch, ids: torch.Tensor):
    if not batch.images:
        return None, None
    spans = [model.encode_image(img, grad=True) for _, _, img in sorted(batch.images, key=lambda r: (r[0], r[1]))]
    return image_inputs(ids, model.args.image_token_id, spans)


def _repeat(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.expand(n, *t.shape[1:]).clone()


def repeat_rows(cache: Cache, n: int) -> Cache:
    """A batch-``n`` cache whose rows all continue the batch-1 ``cache`` (differentiably)."""
    out = Cache(cache.args, batch=n, device=cache.device, spare=cache.spare, kv=cache.kv)
    for mine, theirs in zip(out.windows, cache.windows):
        mine.data, mine.pos = _repeat(theirs.data, n), theirs.pos.clone()
    for s, src in out.sources.items():
        old = cache.sources[s]
        src.n = old.n
        for name in ("records", "index", "hist_kv", "hist_gate"):
            setattr(src, name, _repeat(getattr(old, name), n))
        src.set_pending(_repeat(old.pending_kv, n), _repeat(old.pending_gate, n))
        src.hist_pos = old.hist_pos.clone()
    out.engram_ids, out.engram_pos = _repeat(cache.engram_ids, n), cache.engram_pos.clone()
    out.length = cache.length
    return out


# ----------------------------------------------------------------------------- router balance

class ExpertLoads:
    """Counts the experts each MoE gate picks during a step (forward hooks), text tokens and
    image-span tokens apart: they route with ``bias`` and ``bias_vl`` respectively."""

    def __init__(self, model: Transformer):
        self.gates = {name: m.gate for name, m in model.named_modules() if isinstance(m, MoE)}
        self.counts = {name: torch.zeros(2, g.bias.numel(), device=g.bias.device) for name, g in self.gates.items()}
        self._hooks = [g.register_forward_hook(self._hook(name)) for name, g in self.gates.items()]

    def _hook(self, name: str):
        def hook(_module, inputs, output):
            indices, image_mask = output[1], inputs[1]
            counts = self.counts[name]
            n = counts.shape[1]
            if image_mask is None:
                counts[0] += torch.bincount(indices.flatten(), minlength=n).float()
                return
            for row, picked in ((0, indices[~image_mask]), (1, indices[image_mask])):
                counts[row] += torch.bincount(picked.flatten(), minlength=n).float()
        return hook

    @torch.no_grad()
    def update_bias(self, rate: float) -> float:
        """The aux-loss-free update: raise the bias of under-loaded experts, lower the
        over-loaded (``bias`` from text tokens, ``bias_vl`` from image tokens); returns the
        worst max/mean text load seen, then resets the counts."""
        worst = 0.0
        for name, gate in self.gates.items():
            for row, bias in ((0, gate.bias), (1, gate.bias_vl)):
                load = self.counts[name][row]
                if load.sum() == 0:
                    continue
                bias.add_(rate * torch.sign(load.mean() - load))
                if row == 0:
                    worst = max(worst, float(load.max() / load.mean()))
            self.counts[name].zero_()
        return worst

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def param_groups(model, tower_lr: float = 1.0) -> list[dict]:
    """AdamW groups: weight decay on matrices only (not on the router's biases, which the
    aux-free balance sets), and the learning-rate multiplier ``scale`` — ``tower_lr`` for
    the vision tower and its aligner, 1 elsewhere."""
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad or n.endswith(("gate.bias", "gate.bias_vl")):  # frozen, or set by the balance
            continue
        decay = p.dim() == 2 and not n.endswith("bias")
        scale = tower_lr if n.startswith(("vision.", "aligner.")) else 1.0
        groups.setdefault((decay, scale), []).append(p)
    return [{"params": ps, "weight_decay": 0.01 if decay else 0.0, "scale": scale}
            for (decay, scale), ps in groups.items()]
