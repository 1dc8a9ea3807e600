"""The V4.1 MoE: the router (Gate) and the routed + shared SwiGLU experts.

Owns :class:`Gate` (scores with the aux-loss-free ``bias`` / ``bias_vl`` in the choice only,
top-k, normalised and scaled weights),
:class:`Expert` (SwiGLU with the training clamps) and :class:`MoE`, whose routed experts
run one by one (``MoE._loop``: the reference), all at once as grouped GEMMs from stacked
weights (:class:`GroupedExperts`, no host sync, inference), or densely (``MoE._dense``:
every expert on every token, gate-weighted; no host sync, training on CUDA with few experts);
Parameter names are the official checkpoint names. Does not own: where the FFN sits in a
layer (``model.block.Block``), the router's balance updates (``model.training``), nor a
decode step's whole MoE in the Triton kernels of ``model.kernels.moe``
(``model.decode_step.moe_step``, whose twin this module is).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from model import kernels
from model.args import ModelArgs
from model.checkpoint import dequantize_tensor
from model.linear import ALONE, Linear, World


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, n_experts: int, top_k: int):
        super().__init__()
        self.args, self.top_k = args, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert indices [N, k]) for flat tokens x [N, D]."""
        logits = kernels.fp32_linear(x, self.weight) / self.args.gate_temp
        scores = _score(logits, self.args.scoring_func)
        bias = self.bias if image_mask is None else torch.where(image_mask[:, None], self.bias_vl, self.bias)
        indices = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.args.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.args.routed_scaling_factor, indices


def _score(logits: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(-1) if fn == "softmax" else logits.sigmoid()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up in fp32 with the training clamps: gate clamped above, up both sides."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """SwiGLU with the training clamps; the gate's ``weight`` scales a row before w2.
    ``world``: the intermediate channels split over its ranks (w1 / w3 by rows, w2 by columns),
    each rank's output a partial sum its caller adds over the world (the shared expert's)."""

    def __init__(self, dim: int, inter: int, limit: float, world: World = ALONE):
        super().__init__()
        self.limit = limit
        columns, rows = (None, None) if world.size == 1 else ("column", "row")
        self.w1 = Linear(dim, inter, split=columns, world=world)
        self.w2 = Linear(inter, dim, split=rows, world=world, sums=False)
        self.w3 = Linear(dim, inter, split=columns, world=world)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        y = swiglu(self.w1(x), self.w3(x), self.limit)
        if weight is not None:
            y = weight * y
        return self.w2(y.to(x.dtype))


def grouped_mm_supported(x: torch.Tensor, inter: int) -> bool:
    """Whether ``torch._grouped_mm`` runs experts of width ``inter`` on ``x`` without a host
    sync: on the CPU in fp32/bf16/fp16 (torch loops over the groups there), on CUDA in bf16 on
    sm90/sm100 (its CUTLASS kernel; elsewhere torch's fallback copies the offsets to the host).
    torch also wants every row stride a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or any(n * x.element_size() % 16 for n in (x.shape[-1], inter)):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.is_cuda and x.dtype == torch.bfloat16 and _cuda_major(x.device.index) in (9, 10)


@functools.cache
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


DEQUANT_BYTES = 1 << 30  # the most bytes of floats a packed GroupedLinear dequantises at once


class GroupedLinear(nn.Module):
    """One Linear of every routed expert as one grouped GEMM over rows sorted by expert.
    ``weight`` is a plain tensor, not a parameter: [E, out, in] floats (``fmt`` "plain"), or
    the FP4 bytes [E, out, in / 2] (``fmt`` "fp4", with ``scale`` [E, out, in / 32] e8m0);
    its slices (and the scale's) are the experts' own Linear tensors (:meth:`MoE.stack_experts`),
    so state dicts and checkpoints never see it."""

    def __init__(self):
        super().__init__()
        self.weight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.fmt, self.in_features = "plain", 0

    def hold(self, weight: torch.Tensor | None, scale: torch.Tensor | None = None, in_features: int = 0) -> None:
        """Stacks to compute with: floats, FP4 bytes with their scales, or None (nothing stacked)."""
        self.weight, self.scale = weight, scale
        self.fmt, self.in_features = ("plain", 0) if scale is None else ("fp4", in_features)

    def forward(self, x: torch.Tensor, ends: torch.Tensor,
                gate: tuple["GroupedLinear", torch.Tensor, float] | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in], expert e's rows at [ends[e-1], ends[e]) -> [M, out] in x's dtype. FP4 stacks:
        ``kernels.grouped_fp4`` (their bytes decoded in registers where it runs, else dequantised
        by chunks of experts, its twin); with ``gate`` = (w3, the rows' route weights [M], limit),
        ``route * swiglu(x w^T, x w3^T, limit)``, the up projection whole, and the sorted rows
        may be given as ``x[rows]`` (x unsorted), which the kernel reads where they lie."""
        if gate is not None:
            w3, route, limit = gate

            def twin() -> torch.Tensor:
                h = x if rows is None else x[rows]
                up = swiglu(self._dequantised(h, ends), w3._dequantised(h, ends), limit)
                return (route[:, None] * up).to(x.dtype)

            return kernels.grouped_fp4(x, ends, self.weight, self.scale, twin, paired=(w3.weight, w3.scale),
                                       route=route, limit=limit, rows=rows)
        if self.fmt == "plain":
            return torch._grouped_mm(x, self.weight.mT, offs=ends)  # mat_b column-major: the Linear layout
        return kernels.grouped_fp4(x, ends, self.weight, self.scale, lambda: self._dequantised(x, ends))

    def _dequantised(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The twin: chunks of experts dequantised, one grouped GEMM each."""
        n_experts, out_f = self.weight.shape[:2]
        chunk = max(1, DEQUANT_BYTES // (out_f * self.in_features * x.element_size()))
        out = torch.empty(x.shape[0], out_f, dtype=x.dtype, device=x.device)
        for first in range(0, n_experts, chunk):
            out = self._chunk(x, ends, first, min(first + chunk, n_experts), out)
        return out

    def _chunk(self, x: torch.Tensor, ends: torch.Tensor, first: int, last: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the rows of experts [first, last) written: those experts dequantised
        (no float image of all of them is ever made), their rows turned to the front — a gather
        by a device offset, so nothing is read on the host — and one grouped GEMM over them."""
        rows = torch.arange(x.shape[0], device=x.device)
        start = ends[first - 1] if first else ends.new_zeros(())
        turned = (rows + start) % x.shape[0]  # the chunk's rows first; rows past its last group unread
        y = torch._grouped_mm(x[turned], self.dense(first, last, x.dtype).mT, offs=ends[first:last] - start)
        mine = (rows >= start) & (rows < ends[last - 1])
        return torch.where(mine[:, None], y[(rows - start) % x.shape[0]], out)

    def dense(self, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts [first, last) as floats [n, out, in], dequantised as ``model.checkpoint``
        dequantises each (FP4 scales cover 1 x 32: every row alone, so the experts' rows at once)."""
        w, s = self.weight[first:last], self.scale[first:last]
        n, out_f = w.shape[:2]

        def twin() -> torch.Tensor:
            flat = dequantize_tensor("fp4", w.reshape(n * out_f, -1), s.reshape(n * out_f, -1),
                                     (n * out_f, self.in_features), dtype=dtype)
            return flat.view(n, out_f, self.in_features)

        return kernels.dequantised_fp4_stack(w, s, self.in_features, dtype, twin)


class GroupedExperts(nn.Module):
    """Every routed expert at once, with no host sync: the (token, slot) pairs sorted by
    expert, their rows gathered once (FP4 stacks: read in place by the up projection's kernel),
    w1/w3/w2 as grouped GEMMs, the gate weight applied before w2 as in :class:`Expert`, each
    token's k rows summed in slot order. ``first``: the global index of the first expert
    stacked here; ``split``: a rank of several holding a range of them, whose pairs routed to
    other ranks' experts sort after the last group, which no GEMM reads, and give zeros. On
    FP4 stacks (``fmt``) the up projection (w1 with w3, the SwiGLU and the route weight) and
    the down projection each run one kernel on the stacks' bytes where ``kernels.grouped_fp4``
    can, else dequantise a chunk of experts at a time (:class:`GroupedLinear`): what
    ``MoE._loop`` computes from the same experts, prefill included, with no float image of
    them all."""

    def __init__(self, limit: float, first: int = 0, split: bool = False):
        super().__init__()
        self.limit, self.first, self.split = limit, first, split
        self.w1, self.w2, self.w3 = GroupedLinear(), GroupedLinear(), GroupedLinear()

    @property
    def fmt(self) -> str:
        """How the stacks hold the experts: "plain" floats or "fp4" bytes and scales."""
        return self.w1.fmt

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Routed output [N, D] fp32 of flat tokens x [N, D] from the gate's weights, indices [N, k]."""
        k, n_experts = indices.shape[1], self.w1.weight.shape[0]
        local = (indices - self.first).flatten() if self.split else indices.flatten()
        if self.split:
            mine = (local >= 0) & (local < n_experts)
            local = torch.where(mine, local, n_experts)  # another rank's: after every group here
        order = local.argsort(stable=True)  # (N*k,) by expert, token order within one
        experts = torch.arange(n_experts, device=x.device)
        ends = torch.searchsorted(local[order], experts, right=True, out_int32=True)
        rows = order // k
        route = weights.flatten()[order]
        if self.fmt == "fp4":  # the kernel reads each pair's row of x in place
            y = self.w1(x, ends, gate=(self.w3, route, self.limit), rows=rows)
        else:
            h = x[rows]  # (N*k, D)
            g, u = self.w1(h, ends), self.w3(h, ends)
            y = kernels.routed_swiglu(g, u, route, self.limit,
                                      lambda: (route[:, None] * swiglu(g, u, self.limit)).to(x.dtype))
        out = self.w2(y, ends)

        def slot_sum() -> torch.Tensor:
            # back to (token, slot) order, then each token's k rows summed: no atomics, so a step's
            # result never depends on the order threads finish in (index_add_ on CUDA would)
            unsorted = torch.empty_like(out).index_copy_(0, order, out)
            if self.split:  # rows past the last group: never written
                unsorted = torch.where(mine[:, None], unsorted, 0)
            return unsorted.view(-1, k, out.shape[-1]).float().sum(1)

        return kernels.slot_sum(out, order, k, ends, slot_sum)


DENSE_RATIO = 4  # see MoE.runs_dense


class Experts(nn.ModuleDict):
    """The routed experts a rank holds, named by their global index (``experts.37.w1.weight``,
    the checkpoint's names): indexed by that int, iterated as modules in order."""

    def __getitem__(self, e) -> "Expert":
        return super().__getitem__(str(e))

    def __iter__(self):
        return iter(self.values())

    def __contains__(self, e) -> bool:
        return super().__contains__(str(e))


class MoE(nn.Module):
    """The gate's top-k routed experts plus the shared expert. The routed experts run one
    SwiGLU per expert (``_loop``: the reference), all at once from stacked weights
    (``grouped``, outside autograd) or densely (``_dense``, training on CUDA);
    :meth:`runs_grouped` and :meth:`runs_dense` choose."""

    def __init__(self, args: ModelArgs, n_experts: int | None = None, top_k: int | None = None,
                 world: World = ALONE):
        """``world``: expert parallel over its ranks — each holds a contiguous range of the
        experts and its share of the shared expert's intermediate channels, every rank routes
        every token, and a rank's routed sum plus its shared part meet the others' in one
        all-reduce."""
        super().__init__()
        n_experts = n_experts or args.n_routed_experts
        self.gate = Gate(args, n_experts, top_k or args.num_experts_per_tok)
        inter = args.moe_intermediate_size
        self.world = world
        mine = world.part(n_experts, "n_routed_experts")
        self.experts = Experts({str(e): Expert(args.hidden_size, inter, args.swiglu_limit)
                                for e in range(n_experts)[mine]})
        self.shared_experts = Expert(args.hidden_size, inter, args.swiglu_limit, world)
        self.grouped = GroupedExperts(args.swiglu_limit, mine.start, world.size > 1)
        self.register_load_state_dict_post_hook(_restack_after_load)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens x [..., D] -> the routed experts' weighted sum plus the shared expert's, in x's dtype."""
        shape = x.shape
        return self.routed_and_shared(x.reshape(-1, shape[-1]), image_mask).view(shape)

    def routed_and_shared(self, flat: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        """The MoE of tokens ``flat`` [N, D] (``image_mask`` [..] of N: image-span tokens)."""
        weights, indices = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        routed = self.grouped if self.runs_grouped(flat) else self._dense if self.runs_dense(flat) else self._loop
        y = routed(flat, weights, indices)
        y += self.shared_experts(flat).float()  # over several ranks this rank's part of it
        return self.world.sum(y).to(flat.dtype)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The reference: one Expert call per expert that has tokens (reads their ids on the host)."""
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in indices.unique().tolist():
            if e not in self.experts:  # another rank's
                continue
            rows, slot = torch.where(indices == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None]).float()
        return y

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """What ``_loop`` computes, with no host sync: every expert on every token, its
        SwiGLU scaled by the token's gate weight for it (zero where the gate did not pick
        it), the experts summed inside the w2 product. ``n_experts / top_k`` times the
        expert FLOPs, and as many activations saved for the backward pass."""
        gate = torch.zeros(x.shape[0], len(self.experts), device=x.device, dtype=weights.dtype)
        gate = gate.scatter(1, indices, weights)  # [N, E]; differentiable in the weights
        w1, w2, w3 = (torch.stack([getattr(e, name).weight for e in self.experts]) for name in ("w1", "w2", "w3"))
        h = swiglu(torch.einsum("nd,eid->nei", x, w1), torch.einsum("nd,eid->nei", x, w3), self._first().limit)
        return torch.einsum("nei,edi->nd", (h * gate[:, :, None]).to(x.dtype), w2).float()

    def runs_dense(self, x: torch.Tensor) -> bool:
        """Training on CUDA with few experts (at most ``DENSE_RATIO`` × top-k: the default
        model's 8 and top-2): the loop reads each layer's expert ids on the host, ~9 syncs
        a layer that stop the host queuing work ahead, on steps bound by the host.
        ``DSAGENT_DENSE_MOE=0`` forces the loop."""
        return (x.is_cuda and torch.is_grad_enabled() and self.world.size == 1
                and len(self.experts) <= DENSE_RATIO * self.gate.top_k
                and os.environ.get("DSAGENT_DENSE_MOE", "1") != "0")

    def parametrized(self) -> bool:
        return parametrize.is_parametrized(self._first().w1)  # QAT covers every expert alike

    def _first(self) -> "Expert":
        return next(iter(self.experts))

    def runs_grouped(self, x: torch.Tensor) -> bool:
        """The grouped path computes what the loop does only from stacked, unparametrized weights
        (training's QAT rewrites them) and without autograd; ``DSAGENT_GROUPED_MOE=0`` forces the loop."""
        w = self.grouped.w1.weight
        return (w is not None and not torch.is_grad_enabled()
                and grouped_mm_supported(x, w.shape[1])
                and os.environ.get("DSAGENT_GROUPED_MOE", "1") != "0" and not self.parametrized())

    def stack_experts(self) -> None:
        """Hold the routed experts' w1/w2/w3 as three stacks whose slices become the experts' own
        tensors (nothing is duplicated; names and state dicts are unchanged): [E, out, in] floats,
        or FP4 experts' bytes [E, out, in / 2] and scales [E, out, in / 32] as stored. A no-op
        when they already are; a conversion (``_apply``) or a load by assignment stacks again.
        Experts of another stored format (FP8, ``expert_dtype``) are not stacked: they run one
        by one. Over several ranks a rank stacks the range it holds (``GroupedExperts.first``)."""
        fmt = self._first().w1.fmt
        for name in ("w1", "w2", "w3"):
            grouped = getattr(self.grouped, name)
            if fmt not in ("plain", "fp4"):
                grouped.hold(None)
                continue
            layers = [getattr(e, name) for e in self.experts]
            tensors = [[_stored_weight(m) for m in layers]] + ([[m.scale for m in layers]] if fmt == "fp4" else [])
            held = [grouped.weight, grouped.scale][:len(tensors)]
            if grouped.fmt == fmt and all(h is not None and _views_of(ps, h) for ps, h in zip(tensors, held)):
                continue
            grouped.hold(*(_stack(ps) for ps in tensors), in_features=layers[0].in_features)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.grouped.w1.weight is not None:
            self.stack_experts()  # a dtype or device conversion gave every expert its own tensor again
        return self


def _restack_after_load(moe: MoE, incompatible_keys) -> None:
    """A load by assignment gives the experts new tensors (a copying load keeps the views)."""
    if moe.grouped.w1.weight is not None:
        moe.stack_experts()


def stack_experts(model: nn.Module) -> nn.Module:
    """:meth:`MoE.stack_experts` on every MoE of ``model`` (backbone and draft stages); returns it."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.stack_experts()
    return model


def _stored_weight(linear: nn.Linear) -> nn.Parameter:
    """The parameter a Linear stores: under a parametrization (training's QAT), its original."""
    return linear.parametrizations.weight.original if parametrize.is_parametrized(linear, "weight") else linear.weight


def _stack(params: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked, each then made its slice of the stack."""
    stack = torch.stack([p.detach() for p in params])
    for i, p in enumerate(params):
        p.data = stack[i]
    return stack


def _views_of(params: list[torch.Tensor], stack: torch.Tensor) -> bool:
    """Whether params[i] is exactly stack[i] (same memory, dtype, device and shape)."""
    base, step = stack.data_ptr(), stack.stride(0) * stack.element_size()
    return all(p.device == stack.device and p.dtype == stack.dtype and p.shape == stack.shape[1:]
               and p.is_contiguous() and p.data_ptr() == base + i * step for i, p in enumerate(params))
