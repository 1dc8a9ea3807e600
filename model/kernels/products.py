"""The model's fp32 products on bf16 rows, taken on the tensor cores: no fp32 GEMM on CUDA.

The reference computes three small projections in fp32 (V4.1's own choice, kept): the
router's logits (``F.linear(x.float(), gate.weight.float())``), the compressor's ``wkv`` /
``wgate`` and the mHC mixes (the RMS-normalised flattened streams times ``hc_*_fn``). On
CUDA the rows are bf16, and an fp32 GEMM runs on the CUDA cores at a few percent of the
tensor cores' rate. The same products come from bf16 GEMMs with fp32 sums and output:

- a bf16 weight as it is: a bf16 times a bf16 is exact in fp32, so only the order of the
  sums differs (cuBLAS's fp32 accumulation);
- an fp32 weight (``hc_*_fn``) as three bf16 parts whose sum is the weight exactly
  (:func:`bf16_parts`: 8 + 8 + 8 significant bits for weights above ~2^-100), stacked into
  one GEMM of three times the outputs, the parts' products added in fp32;
- the mixes' RMS norm, a factor of each row, taken after the product
  (:func:`normed_linear`): the streams are read as bf16, never as an fp32 normalised copy.

``runs(x, w)`` says where: CUDA, outside autograd, bf16 rows. Elsewhere (the CPU reference,
training) the plain fp32 products run. Does not own: which projections are fp32 (the model's
modules), the Triton decode kernels' own fp32 dots (``model.kernels.moe`` / ``pack`` / ``streams``).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

_PARTS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(weight) -> (weight, its version, parts)


def runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`fp32_linear` takes the tensor cores for rows ``x`` and weight ``w``."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def bf16_parts(w: torch.Tensor) -> torch.Tensor:
    """fp32 weight [O, I] -> [3 * O, I] bf16: hi, mid, lo stacked, hi + mid + lo == w in fp32.
    Each part is the rounding of what the ones before left; each remainder is exact in fp32,
    so the last part holds the final 8 bits whole."""
    parts, rest = [], w.float()
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.cat(parts)


def _stacked(w: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_parts` of ``w``, made once per weight and its in-place version, dropped with
    the weight (not kept while a CUDA graph is captured, where a new tensor would live in the
    graph's pool)."""
    held = _PARTS.get(id(w))
    if held is not None and held[0]() is w and held[1] == w._version:
        return held[2]
    parts = bf16_parts(w.detach())
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        if held is None or held[0]() is not w:
            weakref.finalize(w, _PARTS.pop, id(w), None)
        _PARTS[id(w)] = (weakref.ref(w), w._version, parts)
    return parts


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times w [N, K] bf16 -> [M, N] fp32: one GEMM with fp32 sums and output
    (CUDA's ``mm`` with ``out_dtype``; elsewhere the same products in fp32, for tests)."""
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), w.float())`` -> [..., O] fp32; through bf16 GEMMs where :func:`runs`."""
    if not runs(x, w):
        return F.linear(x.float(), w.float())
    return _wide(x, w)


def _wide(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bf16 GEMM form of :func:`fp32_linear` (any device: ``_mm`` stands in off CUDA)."""
    flat = x.reshape(-1, x.shape[-1])
    if w.dtype == torch.bfloat16:
        y = _mm(flat, w)
    else:
        y = _mm(flat, _stacked(w)).view(flat.shape[0], 3, w.shape[0]).sum(1)
    return y.view(*x.shape[:-1], w.shape[0])


def normed_linear(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.linear(rms_norm(x.float()), w.float())`` (no norm weight: the mHC mixes) -> [..., O]
    fp32 for a caller where :func:`runs`: the norm as the row's factor after the product,
    rsqrt(mean(x^2) + eps) times x·w, where the reference rounds x times that factor first
    (a few fp32 ulps apart)."""
    return _wide(x, w) * _inverse_rms(x, eps)


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) [..., 1] in fp32, reading x in its own dtype."""
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square() / x.shape[-1]
    return torch.rsqrt(ms + eps)
