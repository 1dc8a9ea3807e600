"""Triton Engram kernels.

Owns ``engram_gate`` (what ``model.kernels.reference.engram_gate_ref`` computes): the Engram
value gated into the residual streams, one launch where torch runs about 25 small kernels
(casts, the two RMS factors, the weighted dot, the signed square root, the sigmoid, the mask,
the sum and the cast back) in each Engram layer. Not bit-exact: the sums over a stream's
channels run in another order than torch's, so the gate agrees to a few fp32 ulps; the
product and the cast back are rounded as torch rounds them (bf16: nearest even, on the bits).

Owns ``ngram_hash`` (what ``ngram_hash_ref`` computes): every Engram layer's row ids of the
n-grams ending at each token, one launch where torch runs ~20 (the look-back's slices and
masks, the products, XORs and remainders) once a step. Integers, so equal to the twin. And
``engram_step``: a decode step's whole Engram look-up in one launch — the new token's
compressed id, the look-back read from the cache's ring, the hash, the ring's write — where
the step ran ~16 (torch's lookups and masks around the hash kernel: ~38 µs at its start on the
H200, 2026-12-04, 3097e7e).

Does not own: the hashed rows and their projection (``model.model.Engram``), or choosing
kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _store, chained, unfused

# a decode step's Engram projections (each layer's hashed rows through its ``wkv``: 126 MB at
# `small`, ~35 µs a layer on the step's path on the H200; 2026-12-04, 3097e7e) launched from the step's start
# on a side stream, beside the layers before theirs (``model.kernels.Beside``). Timed on the H200
# (`small`, a step at 128K, bench_knobs, best of three alternated rounds): 0.987 / 0.989 of inline in
# two calls (controls 0.997 / 1.003); the GEMV kernel beside, where cuBLAS runs it now, 0.994
BESIDE = True


@triton.jit
def _engram_gate_kernel(s_ptr, key_ptr, value_ptr, qw_ptr, kw_ptr, live_ptr, out_ptr, D, s_key, s_value, eps,
                        HC: tl.constexpr, BLOCK_D: tl.constexpr, LIVE: tl.constexpr, BF16: tl.constexpr,
                        PDL: tl.constexpr = False):
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)  # one token's stream k
    k = tl.program_id(1)
    c = tl.arange(0, BLOCK_D)
    m = c < D
    h = tl.load(s_ptr + (row * HC + k) * D + c, mask=m, other=0.0).to(tl.float32)
    key = tl.load(key_ptr + row * s_key + k * D + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(qw_ptr + k * D + c, mask=m, other=0.0).to(tl.float32) * tl.load(kw_ptr + k * D + c, mask=m,
                                                                              other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, 0) / D + eps) * tl.math.rsqrt(tl.sum(key * key, 0) / D + eps)
    dot = tl.sum(h * w * key, 0) * rstd * (1.0 / tl.sqrt(D.to(tl.float32)))
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    root = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign: the sign bit, -0.0 too
    gate = 1.0 / (1.0 + tl.exp(-root))
    if LIVE:
        gate = tl.where(tl.load(live_ptr + row) != 0, gate, 0.0)
    out = h + gate * tl.load(value_ptr + row * s_value + c, mask=m, other=0.0).to(tl.float32)
    _store(out_ptr + (row * HC + k) * D + c, out, m, BF16)


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, live: torch.Tensor | None, eps: float) -> torch.Tensor:
    """streams [..., hc, D] (fp32 / bf16), key [..., hc * D] and value [..., D] (rows may be
    strided views of one projection), weights [hc, D], live [...] bool or None -> streams' shape
    and dtype."""
    hc, D = streams.shape[-2:]
    lead = streams.shape[:-2]
    assert key.shape == lead + (hc * D,) and value.shape == lead + (D,) and q_weight.shape == k_weight.shape == (hc, D)
    assert streams.dtype in (torch.float32, torch.bfloat16) and key.stride(-1) == value.stride(-1) == 1
    assert live is None or (live.shape == lead and live.dtype == torch.bool)
    streams = streams.contiguous()
    key, value = key.reshape(-1, hc * D), value.reshape(-1, D)
    out = torch.empty_like(streams)
    R = key.shape[0]
    if R == 0:
        return out
    bf16 = streams.dtype == torch.bfloat16
    block = triton.next_power_of_2(D)
    _engram_gate_kernel[(R, hc)](streams, key, value, q_weight.contiguous(), k_weight.contiguous(),
                                 streams if live is None else live.contiguous(),
                                 out.view(torch.int16) if bf16 else out, D, key.stride(0), value.stride(0), float(eps),
                                 HC=hc, BLOCK_D=block, LIVE=live is not None, BF16=bf16,
                                 num_warps=4 if block <= 1024 else 8, **unfused(), **chained(streams))
    return out


@triton.jit
def _hashed(tok, shift: tl.constexpr, blocked, rolling, layer, mult_ptr, primes_ptr, offsets_ptr, row_ptr, pad, dead,
            NGRAM: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The token ``shift`` back (newest first) into one layer's rolling n-gram hash (the pad at
    and past a dead one); from the 2-gram on, each head's row id of the n-gram ending here
    written to ``row_ptr`` [(n-1) * heads]. -> (blocked, rolling) for the next token back."""
    j = tl.arange(0, BLOCK_H)
    mj = j < HEADS
    blocked = blocked | (tok == dead)
    rolling = rolling ^ (tl.where(blocked, pad, tok).to(tl.int64) * tl.load(mult_ptr + layer * NGRAM + shift))
    if shift > 0:
        prime = tl.load(primes_ptr + (layer * (NGRAM - 1) + shift - 1) * HEADS + j, mask=mj, other=1)
        offset = tl.load(offsets_ptr + layer * (NGRAM - 1) * HEADS + (shift - 1) * HEADS + j, mask=mj, other=0)
        tl.store(row_ptr + (shift - 1) * HEADS + j, rolling % prime + offset, mask=mj)
    return blocked, rolling


@triton.jit
def _ngram_hash_kernel(c_ptr, hist_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, S, H, pad, dead,
                       NGRAM: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    _chain(PDL)
    t = tl.program_id(0).to(tl.int64)  # one token (row b, position s) and one Engram layer l
    layer = tl.program_id(1)
    L = tl.num_programs(1)
    b, s = t // S, t % S
    cols: tl.constexpr = (NGRAM - 1) * HEADS
    blocked = False
    rolling = tl.zeros((), dtype=tl.int64)
    for shift in tl.static_range(NGRAM):  # newest token first
        at = s - shift
        in_chunk = at >= 0
        tok = tl.where(in_chunk, tl.load(c_ptr + b * S + at, mask=in_chunk, other=0),
                       tl.load(hist_ptr + b * H + H + at, mask=(at < 0) & (H + at >= 0), other=dead))
        blocked, rolling = _hashed(tok, shift, blocked, rolling, layer, mult_ptr, primes_ptr, offsets_ptr,
                                   out_ptr + (t * L + layer) * cols, pad, dead, NGRAM, HEADS, BLOCK_H)


def ngram_hash(compressed: torch.Tensor, history: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
               offsets: torch.Tensor, pad: int, dead: int) -> torch.Tensor:
    """compressed [B, S] and history [B, n-1] int64, multipliers [L, n], primes [L, n-1,
    heads], offsets [L, (n-1) * heads] int64 -> row ids [B, S, L, (n-1) * heads] int64."""
    B, S = compressed.shape
    L, n = multipliers.shape
    heads = primes.shape[-1]
    assert history.shape == (B, n - 1) and primes.shape == (L, n - 1, heads) and offsets.shape == (L, (n - 1) * heads)
    assert all(t.dtype == torch.int64 for t in (compressed, history, multipliers, primes, offsets))
    out = torch.empty(B, S, L, (n - 1) * heads, dtype=torch.int64, device=compressed.device)
    if B * S == 0:
        return out
    _ngram_hash_kernel[(B * S, L)](compressed.contiguous(), history.contiguous(), multipliers.contiguous(),
                                   primes.contiguous(), offsets.contiguous(), out, S, n - 1, pad, dead,
                                   NGRAM=n, HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), num_warps=1,
                                   **chained(compressed))
    return out


@triton.jit(do_not_specialize=["start"])
def _engram_step_kernel(ids_ptr, map_ptr, rid_ptr, rpos_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, start, HR,
                        s_rid, pad, dead, NGRAM: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program (row b, Engram layer): the row's new token at position ``start`` compressed
    (``map``), the tokens before it read from the look-back ring (``rid`` [B, HR] ids at slot
    position % HR, ``rpos`` [HR] the position each slot holds: dead where it holds another),
    the n-gram rows hashed as ``_ngram_hash_kernel`` hashes them; layer 0's program writes the
    new token into the ring (no program reads its slot: HR >= NGRAM)."""
    _chain(PDL)
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    L = tl.num_programs(1)
    cols: tl.constexpr = (NGRAM - 1) * HEADS
    new = tl.load(map_ptr + tl.load(ids_ptr + b))
    blocked = False
    rolling = tl.zeros((), dtype=tl.int64)
    for shift in tl.static_range(NGRAM):  # newest token first
        if shift == 0:
            tok = new
        else:
            at = start - shift
            slot = tl.where(at >= 0, at % HR, 0)
            known = (at >= 0) & (tl.load(rpos_ptr + slot) == at)
            tok = tl.where(known, tl.load(rid_ptr + b * s_rid + slot), dead)
        blocked, rolling = _hashed(tok, shift, blocked, rolling, layer, mult_ptr, primes_ptr, offsets_ptr,
                                   out_ptr + (b * L + layer) * cols, pad, dead, NGRAM, HEADS, BLOCK_H)
    if layer == 0:
        tl.store(rid_ptr + b * s_rid + start % HR, new)
        if b == 0:
            tl.store(rpos_ptr + start % HR, start)


def engram_step(ids: torch.Tensor, token_map: torch.Tensor, ring_ids: torch.Tensor, ring_pos: torch.Tensor,
                start: int, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad: int,
                dead: int) -> torch.Tensor:
    """One decode step's Engram rows in one launch: ids [B, 1] (the new tokens, at position
    ``start``) -> row ids [B, 1, L, (n-1) * heads] int64, as ``NgramHasher.compress``,
    ``Cache.engram_history``, ``ngram_hash`` and ``Cache.record_engram`` make them and leave
    the look-back ring (``ring_ids`` [B, HR], ``ring_pos`` [HR], written in place)."""
    B, S = ids.shape
    L, n = multipliers.shape
    heads = primes.shape[-1]
    HR = ring_pos.shape[0]
    assert S == 1 and HR >= n and ring_ids.shape == (B, HR) and ring_ids.stride(1) == 1 and ring_pos.is_contiguous()
    assert all(t.dtype == torch.int64 for t in (ids, token_map, ring_ids, ring_pos, multipliers, primes, offsets))
    out = torch.empty(B, 1, L, (n - 1) * heads, dtype=torch.int64, device=ids.device)
    _engram_step_kernel[(B, L)](ids.contiguous(), token_map, ring_ids, ring_pos, multipliers.contiguous(),
                                primes.contiguous(), offsets.contiguous(), out, start, HR, ring_ids.stride(0), pad,
                                dead, NGRAM=n, HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), num_warps=1,
                                **chained(ids))
    return out
