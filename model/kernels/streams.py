"""Triton mHC stream kernels: collapse the residual streams into a site's input, and expand
the site's output back into them, one launch each.

Owns ``hc_collapse`` and ``hc_expand`` (what ``model.kernels.reference.hc_collapse_ref`` /
``hc_expand_ref`` compute — the model's own code — twice per layer and decode step each,
where torch runs about four and ten small kernels: fp32 casts, products, an einsum's
layout copies and matmul, sums, the cast back). Bit-exact with the twins: the same fp32
products and sums in the same order, each rounded on its own (``enable_fp_fusion=False``),
and the cast back rounded to nearest even (on the bits for bf16).

Also owns ``hc_site``: one whole mHC site of a decode step's few tokens in two launches
(``model.kernels.hc_site`` says what it computes) — the mixes' dots split over channel
blocks with the expand folded in, then the mixes' split (``model.kernels.fused``'s Sinkhorn
tiles) beside the collapse and the site's norm; in a CUDA graph's capture, on request, the
split on a side stream of its own, which :func:`join` (``model.kernels.mhc_join``) waits for.

Does not own: the mixes ``pre`` / ``post`` / ``comb`` of a prefill chunk (``model.kernels.hc_split``),
or choosing kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import (_bf16_bits, _chain, _hc_split_tiles, _hc_store_split, _rms_normed, _round, _store,
                                 chained, unfused)


@triton.jit
def _collapse_kernel(s_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                     PDL: tl.constexpr = False):
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)  # one token
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = c < D
    acc = tl.load(pre_ptr + row * HC) * tl.load(s_ptr + row * HC * D + c, mask=live, other=0.0).to(tl.float32)
    for k in tl.static_range(1, HC):
        acc = acc + tl.load(pre_ptr + row * HC + k) * tl.load(s_ptr + (row * HC + k) * D + c, mask=live,
                                                               other=0.0).to(tl.float32)
    _store(out_ptr + row * D + c, acc, live, BF16)


@triton.jit
def _expand_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                   BF16: tl.constexpr, PDL: tl.constexpr = False):
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = c < D
    y = tl.load(y_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        acc = tl.load(post_ptr + row * HC + k) * y
        for j in tl.static_range(HC):  # comb[j, k] weighs stream j into stream k
            r = tl.load(r_ptr + (row * HC + j) * D + c, mask=live, other=0.0).to(tl.float32)
            acc = acc + tl.load(comb_ptr + (row * HC + j) * HC + k) * r
        _store(out_ptr + (row * HC + k) * D + c, acc, live, BF16)


def _launch(kernel, rows: int, D: int, *args, bf16: bool):
    block = min(1024, triton.next_power_of_2(D))
    kernel[(rows, triton.cdiv(D, block))](*args, BLOCK_D=block, BF16=bf16, **unfused(), **chained(args[0]))


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [..., hc, D] (fp32 / bf16), pre [..., hc] fp32 -> [..., D] in streams' dtype."""
    hc, D = streams.shape[-2:]
    assert pre.shape == streams.shape[:-1] and pre.dtype == torch.float32
    streams, pre = streams.contiguous(), pre.contiguous()
    out = torch.empty(streams.shape[:-2] + (D,), dtype=streams.dtype, device=streams.device)
    bf16 = streams.dtype == torch.bfloat16
    if out.numel():
        _launch(_collapse_kernel, out.numel() // D, D, streams, pre, out.view(torch.int16) if bf16 else out, D, hc,
                bf16=bf16)
    return out


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [..., D], residual [..., hc, D] (fp32 / bf16), post [..., hc], comb [..., hc, hc] fp32
    -> [..., hc, D] in residual's dtype."""
    hc, D = residual.shape[-2:]
    assert y.shape == residual.shape[:-2] + (D,) and post.shape == residual.shape[:-1]
    assert comb.shape == residual.shape[:-1] + (hc,) and post.dtype == comb.dtype == torch.float32
    y, residual, post, comb = y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    out = torch.empty_like(residual)
    bf16 = residual.dtype == torch.bfloat16
    if out.numel():
        _launch(_expand_kernel, y.numel() // D, D, y, residual, post, comb, out.view(torch.int16) if bf16 else out,
                D, hc, bf16=bf16)
    return out


# ----------------------------------------------------------------------------- one mHC site

SITE_BLOCK_C = 64  # channels per program of the mixes' dots (kernel_sweep.py --only site)
SITE_WARPS = 4
# a caller's request that the site leave its norm to x's consumer (``hc_site``'s ``norm_later``) is
# honoured: the dots launch writes the collapse and the second launch is the split alone (beside the
# layer in a graph). Timed on the H200 (2026-12-03, 0813500, `small`, batch 1, 128K, bench_knobs, best of two
# alternated rounds): 3.716 -> 3.631 ms a step. Tried and not kept then: the dots' program asking for
# its whole 24 KB tile of the mixes' projection before its wait, 3.716 -> 4.336 ms (a dependent
# launch's programs that hold big tiles early take the SMs the kernel before still needs)
NORM_LATER = True
# (2026-12-04, 55ed118: the dots launch folded into the launch that makes the site's y — the attention's
# ``wo_b`` GEMV, the MoE's down sum — one launch a site fewer, was built and timed no faster on the
# H200: a step at 128K 3.001 / 3.096 ms with both folds, 2.883 + 2.865 / 2.991 + 2.930 with neither.
# The FFN site's split, then over 512 channel blocks' partial sums, lay on the step's path. Its code
# is gone; the figures: docs/gpu-fast-path.md)
# warps of the second launch (the split's Sinkhorn, a chain of ~40 reductions of a 4 x 4 tile,
# beside the collapse and norm of the token's D channels): None takes 4 up to 1,024 channels, else
# 8 (the norm's width); fewer may serve the Sinkhorn's reductions better (kernel_sweep --only site)
FINISH_WARPS = None
# with ``overlap`` and ``norm_later``, the dots launch beside too (before the split, on its side stream),
# and the site's input left for its reader to make (``model.kernels.Collapsed``: the projections' GEMV,
# the MoE's gate launch, each collapsing the streams at the channels it reads): the site then puts no
# launch on the step's path. The upper bound, timed as a probe that let the reader race the dots
# launch for its collapse (H200, `small`, a step at 128K, bench_knobs, best of three alternated
# rounds): 0.941 of the step (control 0.998). True: both sites; "attn" / "ffn": that site alone
DOTS_BESIDE = True
# ...and only on streams at most this wide: each reader program collapses the whole row (the norm
# wants its sum of squares), in registers. At V4.1-Flash's 5,120 channels (next power of two 8,192)
# the readers spilled: the wq_a / wkv GEMV took ~170 us a layer where it takes ~15, the gate's logits
# ~45 where ~5. Timed as knobs (2026-12-07, one H100, bench_knobs, a step at 32K, best of three
# alternated rounds; control 0.994 / 1.011): `v41-flash --layers 8` packed 3.768 ms beside, 2.549 with
# both sites' dots on the step's path (attn alone beside 3.421, ffn alone 2.882); `small` (2,048
# channels) bf16 at 128K 3.085 beside, 3.166 not
DOTS_BESIDE_MAX_D = 2048


@triton.jit
def _site_dots_kernel(s_ptr, fn_ptr, dots_ptr, sq_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, pre_in_ptr, x_ptr, D, S,
                      HC: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
                      EXPAND: tl.constexpr, BF16: tl.constexpr, COLLAPSE: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """One token's streams over BLOCK_C channels (expanded first when EXPAND, as
    ``_expand_kernel`` does, and written out): their sum of squares and their dots with the
    mixes' projection ``fn`` [M, HC * D], a partial sum of S per token. COLLAPSE: the site's
    input before its norm, ``x`` = the streams collapsed by ``pre_in`` over the program's
    channels (``_site_input``'s products and sums, in its order), left for the site's
    consumer to normalise (:func:`_site_block`)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c = split * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < D
    _chain(PDL)
    f0, f1, f2, f3 = _site_fn_tiles(fn_ptr, c, live, D, HC, M, M_PAD)
    r0, r1, r2, r3 = _stream_rows(s_ptr, row, c, live, D, HC)
    y = tl.zeros([BLOCK_C], tl.float32)
    if EXPAND:
        y = tl.load(y_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    _site_block(y, c, live, row, split, S, D, f0, f1, f2, f3, r0, r1, r2, r3, post_ptr, comb_ptr, pre_in_ptr, out_ptr,
                x_ptr, dots_ptr, sq_ptr, HC, M_PAD, EXPAND, COLLAPSE, BF16)


@triton.jit
def _site_fn_tiles(fn_ptr, c, live, D, HC: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr):
    """The mixes' projection ``fn`` [M, HC * D] at channels ``c`` of each stream, fp32
    [M_PAD, len(c)] each: four tiles, those of streams past HC (at most four) zeros, unread."""
    m = tl.arange(0, M_PAD)
    mask = (m[:, None] < M) & live[None, :]
    at = fn_ptr + m[:, None] * (HC * D) + c[None, :]
    f0 = tl.load(at, mask=mask, other=0.0, eviction_policy="evict_first")
    f1, f2, f3 = tl.zeros_like(f0), tl.zeros_like(f0), tl.zeros_like(f0)
    if HC > 1:
        f1 = tl.load(at + D, mask=mask, other=0.0, eviction_policy="evict_first")
    if HC > 2:
        f2 = tl.load(at + 2 * D, mask=mask, other=0.0, eviction_policy="evict_first")
    if HC > 3:
        f3 = tl.load(at + 3 * D, mask=mask, other=0.0, eviction_policy="evict_first")
    return f0, f1, f2, f3


@triton.jit
def _pick(k: tl.constexpr, a, b, c, d):
    """The k-th of four (k a constant)."""
    out = a
    if k == 1:
        out = b
    if k == 2:
        out = c
    if k == 3:
        out = d
    return out


@triton.jit
def _site_block(y, c, live, row, split, S, D, f0, f1, f2, f3, r0, r1, r2, r3, post_ptr, comb_ptr, pre_ptr, out_ptr,
                x_ptr, dots_ptr, sq_ptr, HC: tl.constexpr, M_PAD: tl.constexpr, EXPAND: tl.constexpr,
                COLLAPSE: tl.constexpr, BF16: tl.constexpr):
    """An mHC site's work on one token's channels ``c`` (block ``split`` of S), its streams
    there ``r0``..``r3`` (:func:`_stream_rows`, which a launch asks for early, before its own
    sums): with EXPAND those expanded by ``y`` (fp32, the site before's output at c, already in
    its dtype's values) and the mixes' post / comb as ``_expand_kernel`` does, and written to
    ``out``, else taken as they are; their sum of
    squares and dots with the mixes' projection (``f0``..``f3``: :func:`_site_fn_tiles`) into
    the partial sums ``sq`` / ``dots`` [R, S(, M_PAD)]; with COLLAPSE the streams collapsed by
    pre into ``x`` (``_site_input``'s products and sums, in its order)."""
    sq = tl.zeros_like(y)
    col = tl.zeros_like(y)
    acc = tl.zeros_like(f0)
    for k in tl.static_range(HC):
        if EXPAND:
            h = _expanded(k, y, r0, r1, r2, r3, post_ptr, comb_ptr, row, HC)
            if BF16:  # the streams are stored in bf16: the mixes read the rounded values
                bits = _bf16_bits(h)
                tl.store(out_ptr + (row * HC + k) * D + c, bits, mask=live)
                h = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                tl.store(out_ptr + (row * HC + k) * D + c, h, mask=live)
        else:
            h = _pick(k, r0, r1, r2, r3)
        sq += h * h
        if COLLAPSE:
            if k == 0:
                col = tl.load(pre_ptr + row * HC) * h
            else:
                col = col + tl.load(pre_ptr + row * HC + k) * h
        acc += _pick(k, f0, f1, f2, f3) * h[None, :]
    m = tl.arange(0, M_PAD)
    tl.store(dots_ptr + (row * S + split) * M_PAD + m, tl.sum(acc, 1))
    tl.store(sq_ptr + row * S + split, tl.sum(sq, 0))
    if COLLAPSE:  # stored in the streams' dtype, as the collapse is before the norm reads it
        _store(x_ptr + row * D + c, col, live, BF16)


@triton.jit
def _expanded(k: tl.constexpr, y, r0, r1, r2, r3, post_ptr, comb_ptr, row, HC: tl.constexpr):
    """Stream k of one token expanded by y (fp32): post[k] y + sum over j of comb[j, k] r_j
    (comb[j, k] weighs stream j into stream k), in ``_expand_kernel``'s order, unrounded."""
    h = tl.load(post_ptr + row * HC + k) * y
    for j in tl.static_range(HC):
        h = h + tl.load(comb_ptr + (row * HC + j) * HC + k) * _pick(j, r0, r1, r2, r3)
    return h


@triton.jit
def _collapsed(s_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, row, c, live, D, HC: tl.constexpr, EXPAND: tl.constexpr,
               BF16: tl.constexpr):
    """A site's input before its norm at channels ``c`` of token ``row``, made by its reader
    (``DOTS_BESIDE``): the streams — with EXPAND first expanded by y, post and comb, each
    rounded as stored — collapsed by pre and rounded as stored: :func:`_site_block`'s COLLAPSE,
    the same products and sums in the same order, so the same bits."""
    r0, r1, r2, r3 = _stream_rows(s_ptr, row, c, live, D, HC)
    y = tl.zeros_like(r0)
    if EXPAND:
        y = tl.load(y_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    col = tl.zeros_like(r0)
    for k in tl.static_range(HC):
        if EXPAND:
            h = _round(_expanded(k, y, r0, r1, r2, r3, post_ptr, comb_ptr, row, HC), BF16)
        else:
            h = _pick(k, r0, r1, r2, r3)
        if k == 0:
            col = tl.load(pre_ptr + row * HC) * h
        else:
            col = col + tl.load(pre_ptr + row * HC + k) * h
    return _round(col, BF16)


@triton.jit
def _stream_rows(s_ptr, row, c, live, D, HC: tl.constexpr):
    """One token's streams at channels ``c`` in fp32, four rows (those past HC zeros, unread)."""
    at = s_ptr + row * HC * D + c
    r0 = tl.load(at, mask=live, other=0.0).to(tl.float32)
    r1, r2, r3 = tl.zeros_like(r0), tl.zeros_like(r0), tl.zeros_like(r0)
    if HC > 1:
        r1 = tl.load(at + D, mask=live, other=0.0).to(tl.float32)
    if HC > 2:
        r2 = tl.load(at + 2 * D, mask=live, other=0.0).to(tl.float32)
    if HC > 3:
        r3 = tl.load(at + 3 * D, mask=live, other=0.0).to(tl.float32)
    return r0, r1, r2, r3


@triton.jit
def _site_finish_kernel(dots_ptr, sq_ptr, scale_ptr, base_ptr, s_ptr, pre_in_ptr, w_ptr, pre_ptr, post_ptr,
                        comb_ptr, x_ptr, D, S, eps, hc_eps, norm_eps, HC: tl.constexpr, ITERS: tl.constexpr,
                        M_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                        PART: tl.constexpr = 2, PDL: tl.constexpr = False):
    """One token's split and input: (row, 0) sums the partial dots, scales them by the
    streams' rstd (the mixes of the normalised streams) and splits them into pre / post /
    comb (``fused._hc_split_tiles``: its Sinkhorn is a chain of ~40 small reductions);
    (row, 1) collapses the streams with the incoming ``pre`` and RMS-normalises them by ``w``
    (``_collapse_kernel``, ``norm._rms_norm_kernel``). ``PART`` 2: both, two programs side by
    side; 0 or 1: that one alone, one program a token (the split on a stream of its own)."""
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    if PART == 2:
        part = tl.program_id(1)
    else:
        part = PART
    if part == 1:
        _site_input(s_ptr, pre_in_ptr, w_ptr, x_ptr, row, D, norm_eps, HC, BLOCK_D, BF16)
    else:
        _site_split(dots_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, row, D, S, eps, hc_eps,
                    HC, ITERS, M_PAD, S_PAD)


@triton.jit
def _site_split(dots_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, row, D, S, eps, hc_eps,
                HC: tl.constexpr, ITERS: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr):
    s = tl.arange(0, S_PAD)
    sl = s < S
    k = tl.arange(0, HC)
    part = dots_ptr + (row * S + s) * M_PAD
    rstd = tl.math.rsqrt(tl.sum(tl.load(sq_ptr + row * S + s, mask=sl, other=0.0), 0) / (HC * D) + eps)
    pre = tl.sum(tl.load(part[:, None] + k[None, :], mask=sl[:, None], other=0.0), 0) * rstd
    post = tl.sum(tl.load(part[:, None] + HC + k[None, :], mask=sl[:, None], other=0.0), 0) * rstd
    ij = 2 * HC + k[:, None] * HC + k[None, :]
    comb = tl.sum(tl.load(part[:, None, None] + ij[None, :, :], mask=sl[:, None, None], other=0.0), 0) * rstd
    pre, post, comb = _hc_split_tiles(pre[None, :], post[None, :], comb[None, :, :], scale_ptr, base_ptr, hc_eps,
                                      HC, ITERS)
    rows = row + tl.arange(0, 1)
    _hc_store_split(pre_ptr, post_ptr, comb_ptr, rows, rows >= 0, pre, post, comb, HC)


@triton.jit
def _site_input(s_ptr, pre_in_ptr, w_ptr, x_ptr, row, D, norm_eps, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                BF16: tl.constexpr):
    c = tl.arange(0, BLOCK_D)
    live = c < D
    h = tl.load(pre_in_ptr + row * HC) * tl.load(s_ptr + row * HC * D + c, mask=live, other=0.0).to(tl.float32)
    for kk in tl.static_range(1, HC):
        h = h + tl.load(pre_in_ptr + row * HC + kk) * tl.load(s_ptr + (row * HC + kk) * D + c, mask=live,
                                                              other=0.0).to(tl.float32)
    h = _round(h, BF16)  # the collapse is stored in the streams' dtype before the norm reads it
    w = tl.load(w_ptr + c, mask=live, other=0.0).to(tl.float32)
    _store(x_ptr + row * D + c, _rms_normed(h, w, D, norm_eps, BF16), live, BF16)


def hc_site(streams: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_weight: torch.Tensor, eps: float, norm_eps: float, iters: int, hc_eps: float,
            expand: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, overlap: bool = False,
            norm_later: bool = False, dots_beside: bool = False):
    """One mHC site of a few tokens in two launches; see ``model.kernels.hc_site``. With
    ``overlap`` (a CUDA graph's capture, from ``model.kernels.hc_site``, which has joined the
    splits before): the split runs on a side stream, beside the site's input and whatever
    follows it, and :func:`join` makes the current stream wait for it before anything reads
    pre / post / comb. ``norm_later``: x is the collapse before the site's norm, made by the
    dots launch; the second launch is the split alone (its caller's consumer normalises x).
    ``dots_beside`` (with both, ``DOTS_BESIDE``): the dots launch on the side stream too, before
    the split, and x not made: (streams, pre, y, post, comb) in its place, what x's reader
    collapses (:func:`_collapsed`; y, post, comb None without ``expand``)."""
    hc, D = streams.shape[-2:]
    lead = streams.shape[:-2]
    assert fn.shape == ((2 + hc) * hc, hc * D) and fn.dtype == pre.dtype == torch.float32 and hc in (1, 2, 4)
    assert streams.dtype in (torch.float32, torch.bfloat16) and norm_weight.dtype == streams.dtype
    options = {**unfused(), **chained(streams)}  # both launches alike
    pre, streams = pre.contiguous(), streams.contiguous()
    old, bf16 = streams, streams.dtype == torch.bfloat16
    if dots_beside:
        assert overlap and norm_later
        if expand is not None:  # y made on this stream: the side stream waits for it
            expand = tuple(t.contiguous() for t in expand)
        main, side = torch.cuda.current_stream(streams.device), _side_stream(streams.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):  # a plain launch: its stream's last work is that wait
            streams, dots, sq = _site_dots(streams, fn.contiguous(), expand, unfused())
        x, x_arg = (old, pre, *(expand or (None,) * 3)), streams  # x_arg unread by the split
    else:
        x = torch.empty(lead + (D,), dtype=streams.dtype, device=streams.device)
        x_arg = x.view(torch.int16) if bf16 else x
        streams, dots, sq = _site_dots(streams, fn.contiguous(), expand, options, (pre, x) if norm_later else None)
    R, S, M_PAD = dots.shape
    pre_out = torch.empty(*lead, hc, dtype=torch.float32, device=streams.device)
    post_out, comb_out = torch.empty_like(pre_out), torch.empty(*lead, hc, hc, dtype=torch.float32,
                                                                device=streams.device)
    block = triton.next_power_of_2(D)
    args = (dots, sq, scale.float().contiguous(), base.float().contiguous(), streams, pre,
            norm_weight.contiguous(), pre_out, post_out, comb_out, x_arg, D, S, float(eps), float(hc_eps),
            float(norm_eps))
    consts = dict(HC=hc, ITERS=iters, M_PAD=M_PAD, S_PAD=triton.next_power_of_2(S), BLOCK_D=block, BF16=bf16)
    warps = FINISH_WARPS or (4 if block <= 1024 else 8)
    if not overlap:  # the split (and the input, unless the dots made its collapse) after the dots
        grid, part = ((R, 1), 0) if norm_later else ((R, 2), 2)
        _site_finish_kernel[grid](*args, **consts, PART=part, num_warps=warps, **options)
        return streams, pre_out, post_out, comb_out, x
    main = torch.cuda.current_stream(streams.device)
    side = _side_stream(streams.device)
    if not dots_beside:
        side.wait_stream(main)  # the dots
    with torch.cuda.stream(side):  # a plain launch: its stream's last work is that wait, not a kernel
        _site_finish_kernel[(R, 1)](*args, **consts, PART=0, num_warps=warps, **unfused())  # warps: the same sums
    # what the split reads and writes lives until the join: the allocator must not hand its
    # memory to the current stream while the side stream may still use it
    _PENDING.append((side, (dots, sq, *args[2:4], pre_out, post_out, comb_out, old, *(expand or ()))))
    if not norm_later:
        _site_finish_kernel[(R, 1)](*args, **consts, PART=1, num_warps=warps, **options)
    return streams, pre_out, post_out, comb_out, x


_PENDING: list = []  # (side stream, the tensors its split reads and writes) not yet joined
_SIDE: dict = {}  # device index -> its side stream, made once


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def forget() -> None:
    """Drop the pending splits unjoined: a capture that failed never ran them, and its
    streams are not to be waited on."""
    _PENDING.clear()


def join() -> None:
    """Make the current stream wait for every split that :func:`hc_site` ran beside it (no-op
    when none is pending). Before anything reads their pre / post / comb, and before a CUDA
    graph's capture ends: ``model.kernels`` joins in each site, collapse and expand; the
    model's whole-step graph at its end."""
    if not _PENDING:
        return
    main = torch.cuda.current_stream()
    for side in {id(side): side for side, _ in _PENDING}.values():
        main.wait_stream(side)
    _PENDING.clear()


def _site_dots(streams: torch.Tensor, fn: torch.Tensor, expand, options: dict, collapse=None):
    """The first launch: (the site's streams — new ones when ``expand`` —, the partial dots
    [R, S, M_PAD] and sums of squares [R, S] of S channel blocks a token). ``collapse`` =
    (pre, x): the streams collapsed by pre written to x too."""
    hc, D = streams.shape[-2:]
    R, S, M = streams.numel() // (hc * D), triton.cdiv(D, SITE_BLOCK_C), fn.shape[0]
    dots = torch.empty(R, S, triton.next_power_of_2(M), dtype=torch.float32, device=streams.device)
    sq = torch.empty(R, S, dtype=torch.float32, device=streams.device)
    out, y, post, comb = streams, streams, streams, streams  # unread without EXPAND
    if expand is not None:
        y, post, comb = (t.contiguous() for t in expand)
        assert y.shape == streams.shape[:-2] + (D,) and post.dtype == comb.dtype == torch.float32
        out = torch.empty_like(streams)
    bf16 = streams.dtype == torch.bfloat16
    view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    pre, x = collapse if collapse is not None else (streams, out)  # unread without COLLAPSE
    _site_dots_kernel[(R, S)](streams, fn, dots, sq, y, post, comb, view(out), pre, view(x), D, S,
                              HC=hc, M=M, M_PAD=dots.shape[-1], BLOCK_C=SITE_BLOCK_C, EXPAND=expand is not None,
                              BF16=bf16, COLLAPSE=collapse is not None, num_warps=SITE_WARPS, **options)
    return out, dots, sq
