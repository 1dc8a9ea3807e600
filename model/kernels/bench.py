"""Timing of the fused decode kernels against their PyTorch twins at a preset's decode shapes.

Owns ``bench_kernels``: ms per call of kernel and twin on random packed inputs, the packed
bytes one call must read and the GB/s that makes, and the largest kernel-twin difference
as a sanity check. Meant for the GPU (the interpreter's times mean nothing). Returns a plain
dict; printing is the caller's job. Not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import time

import torch

from model.args import ModelArgs
from model.kernels import indexer_scores_ref, sparse_attention_ref, triton_available
from model.blockfp import fake_quant_fp4, index_record_bytes, main_record_bytes, pack_index, pack_main, pack_window
from model.blockfp import INDEX_BLOCK, quantize_fp8_weight, window_record_bytes


def packed_experts(routed: tuple, shared: tuple) -> tuple[list, tuple]:
    """Float experts as a packed model holds them, for ``moe_decode``: the routed stacks
    (w1, w3 [E, I, D], w2 [E, D, I]) as FP4 bytes with their 1 x 32 scales, the shared
    expert's weights as FP8 ``Packed`` (128 x 128 scales); each on its tensor's device.
    -> ([w1, w3, w2, s1, s3, s2], the routed stacks' scales)."""
    from model.checkpoint import quantize_fp4
    from model.kernels.packed import Packed

    def fp4(stack):
        data, scale = quantize_fp4(stack.flatten(0, 1).float().cpu())
        return data.view(*stack.shape[:2], -1).to(stack.device), scale.view(*stack.shape[:2], -1).to(stack.device)

    def fp8(w):
        data, scale = quantize_fp8_weight(w.float().cpu(), 128)
        return Packed(data.to(w.device), scale.to(w.device), "fp8", (128, 128), w.shape[1], None)

    stacks = [fp4(t) for t in routed]
    return [*(d for d, _ in stacks), *(fp8(w) for w in shared)], tuple(c for _, c in stacks)


def decode_shapes(args: ModelArgs, batch: int = 1, spare: int = 16) -> dict:
    """One decode step of a layer reading the candidate pool: ring slots (window + the
    cache's spare), records in the pool, top-k, and the indexer's heads and width."""
    return {"B": batch, "H": args.num_attention_heads, "D": args.head_dim, "W": args.sliding_window + spare,
            "N": args.candidate_topk_blocks * args.candidate_block_size, "K": args.index_topk,
            "Hi": args.index_n_heads, "d": args.index_head_dim}


def _inputs(s: dict, device) -> tuple[list, list]:
    """Random packed inputs, every window slot valid and every selection distinct and live."""
    g = torch.Generator().manual_seed(0)
    B, H, D, W, N, K = (s[k] for k in ("B", "H", "D", "W", "N", "K"))
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)])
    attn = [torch.randn(B, H, D, generator=g).bfloat16(), pack_window(torch.randn(B, W, D, generator=g)),
            torch.ones(B, W, dtype=torch.bool), pack_main(torch.randn(B, N, D, generator=g)), idx,
            torch.randn(H, generator=g)]
    q = fake_quant_fp4(torch.randn(B, s["Hi"], s["d"], generator=g), INDEX_BLOCK)
    index = [q, torch.randn(B, s["Hi"], generator=g), pack_index(torch.randn(B, N, s["d"], generator=g))]
    return [t.to(device) for t in attn] + [D ** -0.5], [t.to(device) for t in index] + [N, s["d"] ** -0.5]


def _ms_per_call(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) * 1e3 / iters


def _compare(kernel, twin, args: list, nbytes: int, device, iters: int) -> dict:
    ref_ms = _ms_per_call(lambda: twin(*args), device, iters)
    row = {"bytes": nbytes, "reference_ms": ref_ms, "reference_gb_s": nbytes / ref_ms / 1e6}
    if kernel is not None:
        ms = _ms_per_call(lambda: kernel(*args), device, iters)
        diff = (kernel(*args) - twin(*args)).nan_to_num(posinf=0.0, neginf=0.0).abs().max().item()
        row.update(kernel_ms=ms, kernel_gb_s=nbytes / ms / 1e6, speedup=ref_ms / ms, max_abs_diff=diff)
    return row


def bench_kernels(device="cuda", preset_shapes: dict | None = None, iters: int = 50) -> dict:
    """ms per call, kernel vs twin, at ``preset_shapes`` (default: the ``small`` preset's
    :func:`decode_shapes`). Kernel entries are absent when Triton cannot run here."""
    s = preset_shapes or decode_shapes(ModelArgs.preset("small"))
    attn, index = _inputs(s, device)
    fused = None
    if triton_available():
        from model.kernels import fused
    attn_bytes = s["B"] * (s["W"] * window_record_bytes(s["D"]) + s["K"] * main_record_bytes(s["D"]))
    index_bytes = s["B"] * s["N"] * index_record_bytes(s["d"])
    return {"device": str(device), "shapes": dict(s),
            "sparse_attention": _compare(fused and fused.sparse_attention, sparse_attention_ref, attn, attn_bytes,
                                         device, iters),
            "indexer_scores": _compare(fused and fused.indexer_scores, indexer_scores_ref, index, index_bytes,
                                       device, iters)}
