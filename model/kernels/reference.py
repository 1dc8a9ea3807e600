"""Pure-PyTorch twins of the fused decode kernels: the semantics the kernels must match.

Owns ``rope_ref`` (the model's RoPE rotation, given cos / sin), ``rms_norm_ref`` (its
RMSNorm), ``hc_split_ref`` (the mHC mixes after their projection: sigmoid pre / post and
the Sinkhorn-normalised comb), ``hc_collapse_ref`` / ``hc_expand_ref`` (the streams into a
site's input and its output back into the streams), ``engram_gate_ref`` (the Engram value
gated into the streams), ``ngram_hash_ref`` (the Engram rows of the n-grams ending at each
token) — the model computes with these seven, so they are its own code, not copies — and
two functions on *packed* cache
bytes, one decode step (one query per row):
``sparse_attention_ref`` (``Attention.attend`` for S=1: one softmax over the valid window
entries, the selected FP4 records and the per-head sink, shared K=V latent) and
``indexer_scores_ref`` (``Indexer.scores`` for S=1: weighted-ReLU scores against FP4 index
keys). Both unpack with ``model.blockfp`` and compute in fp32, in the same order as the
model, so ``tests/test_kernels.py`` can check twin == model on a tiny model and kernel ==
twin on random bytes. And the model's top-k, ``stable_topk`` / ``top_records`` (its own code,
here so that ``topk_rows_ref``, a decode step's top-k in the kernel's order, is the same
choice). Runs on any device.

Does not own: choosing kernel or twin (``model.kernels``), building ``window_valid`` from
ring positions, or gathering anything out of a cache.
"""
from __future__ import annotations

import numpy as np
import torch

from model.blockfp import unpack_index, unpack_main, unpack_window


def sparse_attention_ref(q: torch.Tensor, window: torch.Tensor, window_valid: torch.Tensor,
                         records: torch.Tensor, record_idx: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Out [B, H, D] fp32 of one decode step.

    q [B, H, D] float; window uint8 [B, W, D + D/32] (FP8 rows); window_valid bool [B, W];
    records uint8 [B, N, D/2 + D/16] (FP4 rows); record_idx int [B, K] into records, -1 =
    none (every entry must be -1 or < N); sink [H] float (any dtype); scale: the softmax scale.
    """
    B, H, D = q.shape
    qf = q.float()
    keys = unpack_window(window, D)  # (B, W, D)
    logits = [(torch.einsum("bhd,bjd->bhj", qf, keys) * scale).masked_fill(~window_valid[:, None, :], float("-inf"))]
    rec = _selected_records(records, record_idx, D)
    if rec is not None:
        r = torch.einsum("bhd,bkd->bhk", qf, rec) * scale
        logits.append(r.masked_fill(record_idx[:, None, :] < 0, float("-inf")))
    logits.append(sink.float().view(1, H, 1).expand(B, H, 1))
    probs = torch.cat(logits, dim=-1).softmax(dim=-1)
    W = keys.shape[1]
    out = torch.einsum("bhj,bjd->bhd", probs[..., :W], keys)
    if rec is not None:
        out = out + torch.einsum("bhk,bkd->bhd", probs[..., W:-1], rec)
    return out


def _selected_records(records: torch.Tensor, record_idx: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Unpacked rows [B, K, D] at ``record_idx`` (row 0 stands in for -1), or None when
    nothing can be selected."""
    B, K = record_idx.shape
    if K == 0 or records.shape[1] == 0:
        return None
    rows = records.gather(1, record_idx.long().clamp_min(0)[..., None].expand(B, K, records.shape[-1]))
    return unpack_main(rows, dim)


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, n_visible, head_scale: float,
                       rows: torch.Tensor | None = None, weight_scale: float = 1.0) -> torch.Tensor:
    """Scores [B, N] fp32: sum_h w[b, h] * relu(q[b, h] . key[b, n]) * head_scale, with w =
    ``weights.float() * weight_scale``; -inf at n >= n_visible: an int, a one-element tensor
    or one count a row [B], or (position [1] or [B], ratio): the records that position sees,
    (position + 1) // ratio.

    q [B, Hi, d] float (already FP4-fake-quantised, as ``KVFormat.index_query`` makes it);
    weights [B, Hi]: ``weights_proj(x)``, and weight_scale ``n_heads**-0.5``; keys uint8 [B,
    N, d/2 + d/32] (FP4 index keys); head_scale: ``head_dim**-0.5``. ``rows`` [B, M] (int, -1
    = none): the scores [B, M] of those keys alone, -inf at -1 and at rows >= n_visible (a
    candidate pool's records). Top-k is the caller's (torch).
    """
    if isinstance(n_visible, tuple):
        n_visible = (n_visible[0] + 1) // n_visible[1]
    if isinstance(n_visible, torch.Tensor):  # one count, or one a row
        n_visible = n_visible.reshape(-1, 1)
    (B, _, d), N = q.shape, keys.shape[1]
    if rows is not None:
        keys = keys.gather(1, rows.long().clamp(0, max(N - 1, 0))[..., None].expand(-1, -1, keys.shape[-1])) \
            if N else keys.new_zeros(B, rows.shape[1], keys.shape[-1])
        at, N = rows.long(), rows.shape[1]
    else:
        at = torch.arange(N, device=keys.device)
    if N == 0:
        return torch.zeros(B, 0, device=keys.device)
    k = unpack_index(keys, d)  # (B, N, d)
    s = torch.einsum("bhd,bnd->bhn", q.float(), k).relu_() * head_scale
    s = (s * (weights.float() * weight_scale).unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(~((at >= 0) & (at < n_visible)), float("-inf"))


# the most rows (tokens) whose Sinkhorn loop runs on the host through numpy (``hc_split_ref``'s
# ``host``): on a decode step's 4 x 4 tiles torch's ~120 operators a site cost more in calls than in
# sums. One CPU thread, hc 4, 20 iterations (2026-12-07): a site 287 -> 155 us at 1 row, 441 -> 285
# at 32, 437 -> 412 at 64, 601 -> 701 at 128; the default model's decode step at 2K context 36.74 ->
# 34.65 ms (``bench_knobs``, four alternated rounds, control 1.001)
SINKHORN_HOST_ROWS = 64


def hc_split_ref(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                 eps: float, host: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) * hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]:
    pre = sigmoid + eps, post = 2 sigmoid, comb = softmax over its last axis + eps, then
    ``iters`` Sinkhorn normalisations (columns first, then rows and columns ``iters - 1``
    more times). ``host`` (CPU tensors, no gradient): the normalisations through numpy, the
    same fp32 sums of ``hc`` terms in order, adds and divisions, so the same bits."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    if host:
        return pre, post, _sinkhorn_on_host(comb, iters, eps)
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def _sinkhorn_on_host(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``hc_split_ref``'s normalisations of a CPU fp32 ``comb`` (its own, made there) in numpy,
    in place."""
    assert comb.device.type == "cpu" and comb.dtype == torch.float32 and not comb.requires_grad
    c = comb.numpy()
    e = np.float32(eps)
    c /= c.sum(-2, keepdims=True) + e
    for _ in range(iters - 1):
        c /= c.sum(-1, keepdims=True) + e
        c /= c.sum(-2, keepdims=True) + e
    return torch.from_numpy(c)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The trailing 2·r channels of x [B, S, D] or [B, S, H, D] rotated in adjacent pairs
    (even, odd) -> (even·cos − odd·sin, even·sin + odd·cos) in fp32 by cos / sin [S, r], cast
    back to x's dtype; the other channels as they are. ``model.rope.apply_rope`` rotates
    with it, so this is the model's own code."""
    if x.ndim == 4:
        cos, sin = cos[:, None], sin[:, None]
    rd = cos.shape[-1] * 2
    even, odd = x[..., -rd::2].float(), x[..., -rd + 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


def ngram_hash_ref(compressed: torch.Tensor, history: torch.Tensor, multipliers: torch.Tensor,
                   primes: torch.Tensor, offsets: torch.Tensor, pad: int, dead: int) -> torch.Tensor:
    """Engram row ids [B, S, L, (n-1) * heads] of the 2- to n-grams ending at each token of
    ``compressed`` [B, S] (compressed ids, ``dead`` at image tokens), the ``history`` [B, n-1]
    of compressed ids before it (oldest first; ``dead`` where the look-back is blocked). A
    token at or before a dead one in the look-back reads as ``pad``. Per layer l and n-gram
    length i + 1: the XOR of token t back times ``multipliers[l, t]`` over t <= i, modulo
    each head's prime ``primes[l, i - 1]``, plus that column's table offset ``offsets[l]``
    (int64; the products stay below 2**63, so the XOR and the remainder are non-negative)."""
    seq = torch.cat([history, compressed], dim=1)
    h, S = history.shape[1], compressed.shape[1]
    tokens, blocked = [], torch.zeros_like(compressed, dtype=torch.bool)
    for shift in range(multipliers.shape[1]):
        source = seq[:, h - shift: h - shift + S]
        blocked = blocked | (source == dead)
        tokens.append(source.masked_fill(blocked, pad))
    products = torch.stack(tokens, dim=-1).unsqueeze(2) * multipliers  # [B, S, L, n], newest first
    rolling, hashes = products[..., 0], []
    for i in range(1, multipliers.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + offsets


def engram_gate_ref(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, live: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Streams [..., hc, D] plus the Engram value [..., D] gated per stream: the gate is the
    sigmoid of the signed square root of the RMS-normalised dot of each stream with its key
    (``key`` [..., hc * D]) under the weights ``q_weight * k_weight`` [hc, D], scaled by
    D^-1/2; 0 where ``live`` [...] is False (image tokens). In fp32, cast back
    (``model.model.Engram``)."""
    D = streams.shape[-1]
    key = key.float().unflatten(-1, (streams.shape[-2], D))
    h = streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (q_weight.float() * k_weight.float()) * key).sum(-1) * rstd * D ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if live is not None:
        gate = gate.masked_fill(~live.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype, times ``weight`` (None:
    none, as the mHC mixes normalise) (``model.layer.RMSNorm`` normalises with it, so this
    is the model's own code)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) if weight is None else weight * h.to(x.dtype)


def hc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """A site's input from the residual streams [..., hc, D]: sum over k of pre_k · stream_k
    [..., D] in fp32, k in order, cast back to the streams' dtype (``model.model.hc_collapse``)."""
    s = streams.float()
    out = pre[..., 0, None] * s[..., 0, :]
    for k in range(1, s.shape[-2]):
        out = out + pre[..., k, None] * s[..., k, :]
    return out.to(streams.dtype)


def hc_expand_ref(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a site: out_k = post_k · y + sum over j (in order) of comb[j, k] ·
    residual_j, in fp32, cast back to the residual's dtype (``model.model.hc_expand``)."""
    r = residual.float()
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2)
    for j in range(r.shape[-2]):
        out = out + comb[..., j, :, None] * r[..., j, None, :]
    return out.to(residual.dtype)


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with exact ties broken towards the lower index, so the
    choice never depends on how long the tensor is (chunked prefill vs one pass). FP4
    index scores make exact ties common; the reference leaves them unspecified. (A top-k
    over unique int64 keys — order-preserving score bits above, the index's complement
    below — picks the same, but torch's one-row top-k of int64 took 57 us a call on the
    H200, where the sort's main radix kernel takes ~8; 2026-12-01, 8d9f0f3.)"""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def top_records(scores: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The records of the top-k ``scores`` [..., n] (:func:`stable_topk`), -1 where the score
    is -inf; ``rows`` [..., n]: the records the scores are of (a candidate pool's), else their
    positions."""
    values, indices = stable_topk(scores, k)
    if rows is not None:
        indices = rows.gather(-1, indices)
    return indices.masked_fill(values == float("-inf"), -1)


def topk_rows_ref(scores: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                  width: int | None = None) -> torch.Tensor:
    """Twin of ``model.kernels.select.topk_rows``: :func:`top_records` of each row of
    ``scores`` [R, n] in ascending order, -1 after them up to ``width`` (None: min(k, n))."""
    k = min(k, scores.shape[-1])
    last = torch.iinfo(torch.int64).max
    chosen = top_records(scores, k, rows)
    chosen = chosen.masked_fill(chosen < 0, last).sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == last, -1)
    width = k if width is None else width
    return torch.nn.functional.pad(chosen, (0, width - k), value=-1) if width > k else chosen
