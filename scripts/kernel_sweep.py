"""Time the decode kernels' tile settings at a preset's shapes on the GPU, one JSON line each.

    python3 scripts/kernel_sweep.py OUT.jsonl [--preset small] [--batch 1] [--only attention,splits,gemv,
        gemv-sweep,moe,indexer,mhc,site,grouped,compare,down,up,up-loop,rows,gate,attention-prefill,
        index-prefill,topk]  (gemv, compare: the
        fast path against torch only; down: the MoE's down sum slot by slot against every slot at once,
        then the latter's tiles, the former's, then with DOWN_EARLY off and on; up: UP_EARLY off and on with its rows and warps;
        gate: the gate's two launches alone at the preset's whole expert count, whatever --experts
        says; up-loop: the up kernel's channel loop's rows, width and warps, experts cycled; rows: with
        --fp4, the row kernels' rows, bytes a step and warps, experts cycled; index-prefill: a chunk
        of 8,192 queries' index scores at 32K and 128K, ``model.kernels.prefill``'s INDEX_* tiles)
        [--fp4] (the MoE kinds on FP4 routed experts and an FP8 shared one, as a packed model holds them:
        by pair the row kernels, so down, up and up-loop time the plain kernels only without it)
        [--experts N] (at most N routed experts: `--preset v41-flash --experts 32` for its width)
        [--ranks N] (the MoE kinds on rank 0's part of an expert-parallel MoE over N ranks: a
        range of E / N experts, I / N of the shared expert's channels, routing over all E)

Each setting (the module constants of ``model.kernels.fused``, ``.moe``, ``.streams`` and
``.matvec``) is timed as a decode step runs it: 20 calls captured in one CUDA graph,
replayed, the time per call — so launch gaps inside a graph count and Python does not. The
output of every setting is compared with the default setting's (``max_abs_diff``), so a
fast wrong tiling shows. A guide for choosing the constants, not a test. The 20 calls read
the same inputs, which the 50 MB L2 holds when they are smaller (one layer's attention or
MoE at batch 1): those µs are L2-warm; the GEMV's calls read 20 copies of the weights.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.args import ModelArgs  # noqa: E402
from model import kernels  # noqa: E402
from model.kernels import bench as kbench, fused, matvec, moe, prefill, streams  # noqa: E402
from model.blockfp import pack_main, pack_window  # noqa: E402

CALLS = 20
DEVICE = "cuda"


def graphed_us(fn, calls: int = CALLS) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (best of 5 replays)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    return best


def with_settings(module, settings: dict, fn):
    """``fn()`` with ``module``'s constants set to ``settings``, then put back."""
    before = {n: getattr(module, n) for n in settings}
    try:
        for n, v in settings.items():
            setattr(module, n, v)
        return fn()
    finally:
        for n, v in before.items():
            setattr(module, n, v)


def cycling(items: list):
    """A function of no arguments returning ``items`` in turn: each call of a graph gets its own."""
    turn = itertools.count()
    return lambda: items[next(turn) % len(items)]


def sweep(module, settings: dict[str, list], fn, emit, label: str, check=None) -> None:
    """Each setting of ``module``'s constants: ``fn`` timed, and ``check`` (``fn`` if None: a
    function of the same inputs every call) against its output at the default setting."""
    names = list(settings)
    base = {n: getattr(module, n) for n in names}
    check = check or fn
    reference = check().clone()
    for values in itertools.product(*settings.values()):
        setting = dict(zip(names, values))
        try:
            diff, us = with_settings(module, setting, lambda: ((check() - reference).abs().max().item(),
                                                               graphed_us(fn)))
            emit({"kernel": label, **setting, "us": round(us, 2), "max_abs_diff": diff,
                  "default": all(base[n] == v for n, v in setting.items())})
        except Exception as e:  # a tiling that does not build (registers, shared memory)
            emit({"kernel": label, **setting, "error": f"{type(e).__name__}: {str(e)[:120]}"})


def scaled_bf16(g: torch.Generator, device, *shape) -> torch.Tensor:
    """A random bf16 weight (or rows) of unit-variance products: entries ~ N(0, 1 / shape[-1])."""
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device, torch.bfloat16)


def moe_inputs(args: ModelArgs, batch: int, device, ranks: int = 1) -> tuple[list, dict]:
    """A MoE's decode inputs; over ``ranks`` rank 0's part (``moe_decode``'s ``first``): the
    gate over every expert, the first E / ranks experts, I / ranks of the shared expert's channels."""
    g = torch.Generator().manual_seed(0)
    E, I, D = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    S = I * args.n_shared_experts
    assert E % ranks == 0 and S % ranks == 0, f"{E} experts, {S} shared channels over {ranks} ranks"
    EL, S = E // ranks, S // ranks
    w = functools.partial(scaled_bf16, g, device)

    tensors = [torch.randn(batch, D, generator=g).to(device, torch.bfloat16),
               (torch.randn(E, D, generator=g) * D ** -0.5).to(device), torch.zeros(E, device=device),
               w(EL, I, D), w(EL, I, D), w(EL, D, I), w(S, D), w(S, D), w(D, S)]
    config = dict(top_k=args.num_experts_per_tok, scoring=args.scoring_func, temp=args.gate_temp,
                  norm=args.norm_topk_prob, scale=args.routed_scaling_factor, limit=args.swiglu_limit, first=0)
    return tensors, config


def fp4_experts(tensors: list, config: dict) -> tuple[list, dict]:
    """:func:`moe_inputs` as a packed model holds them: the routed experts FP4 (bytes and 1 x 32
    scales, stacked), the shared expert FP8 (128 x 128 scales), read as stored."""
    experts, scales = kbench.packed_experts(tuple(tensors[3:6]), tuple(tensors[6:]))
    return [*tensors[:3], *experts], {**config, "scales": scales}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--only", default="attention,moe,indexer,mhc,site,grouped,gemv-sweep")
    p.add_argument("--fp4", action="store_true", help="the MoE kinds on a packed model's experts: FP4 routed, "
                                                      "FP8 shared")
    p.add_argument("--experts", type=int, default=None,
                   help="at most this many routed experts (a wide preset's 384 are ~27 GB of floats to make and pack; "
                        "a decode step reads only its top-k of them)")
    p.add_argument("--ranks", type=int, default=1,
                   help="the MoE kinds on rank 0's part over this many ranks (its expert range, its shared channels)")
    a = p.parse_args()
    args = whole = ModelArgs.preset(a.preset)
    if a.experts:
        args = args.replace(n_routed_experts=min(a.experts, args.n_routed_experts))
    with open(a.out, "a") as out:
        def emit(d):
            d = {"preset": a.preset, "batch": a.batch, **({"ranks": a.ranks} if a.ranks > 1 else {}), **d}
            out.write(json.dumps(d) + "\n")
            out.flush()
            print(json.dumps(d), flush=True)

        only = a.only.split(",")
        shapes = kbench.decode_shapes(args, a.batch)
        shapes["N"] = max(shapes["N"], 32 * shapes["K"])  # a long context's records (16K), K of them picked
        attn, index = kbench._inputs(shapes, DEVICE)
        if "attention" in only:
            emit({"kernel": "attention-shapes", **shapes})
            sweep(fused, {"ATTN_BLOCKWISE": [True, False], "BLOCK_N": [16, 32], "ATTN_WARPS": [4, 8],
                          "MIN_BLOCKS_PER_SPLIT": [1, 2]},
                  lambda: fused.sparse_attention(*attn), emit, "sparse_attention")
        if "attention-prefill" in only:  # a prefill chunk's queries, each a row of one split, the records shared
            g = torch.Generator().manual_seed(6)
            S, H, D, span = 2048, args.num_attention_heads, args.head_dim, args.sliding_window
            N, K = 16384, args.index_topk  # a 32K context's ratio-2 records
            pre = [torch.randn(S, H, D, generator=g).to(DEVICE, torch.bfloat16),
                   pack_window(torch.randn(span + S, D, generator=g)).to(DEVICE),
                   torch.arange(span + S, device=DEVICE), pack_main(torch.randn(N, D, generator=g)).to(DEVICE),
                   torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(S)]).to(DEVICE),
                   torch.randn(H, generator=g).to(DEVICE)]
            emit({"kernel": "attention-prefill-shapes", "S": S, "H": H, "D": D, "span": span, "N": N, "K": K})
            run = lambda: kernels.sparse_prefill(*pre, D ** -0.5, out_dtype=torch.bfloat16)  # noqa: E731
            # the keys decoded once a call (``model.kernels.prefill``; its wide form at 64 heads or more),
            # then the decode kernel a query a row
            warps = "WIDE_WARPS" if prefill.wide_form(H, torch.bfloat16) else "WARPS"
            sweep(prefill, {"BLOCK_N": [16, 32, 64], warps: [4, 8], "STAGES": [1, 2, 3]}, run,
                  emit, "sparse_prefill-decoded")
            os.environ["DSAGENT_PREFILL_KERNELS"] = "rows"
            # (BLOCK_H 32 and 64, for V4.1-Flash's 64 heads: their sm_90 builds spill 668 and 13,960 bytes)
            sweep(fused, {"BLOCK_N": [16], "ATTN_WARPS": [8]}, run, emit, "sparse_prefill-rows")
            del os.environ["DSAGENT_PREFILL_KERNELS"]
        if "index-prefill" in only:  # a prefill chunk's index scores against a 32K and a 128K context's keys
            from model.quant import pack_index

            g = torch.Generator().manual_seed(7)
            S, HI, DI, ratio = 8192, args.index_n_heads, args.index_head_dim, 2
            for ctx in (32768, 131072):
                N = ctx // ratio
                pre = [torch.randn(S, HI, DI, generator=g).to(DEVICE, torch.bfloat16),
                       torch.randn(S, HI, generator=g).to(DEVICE),
                       pack_index(torch.randn(N, DI, generator=g)).to(DEVICE),
                       torch.arange(ctx - S, ctx, device=DEVICE), ratio, DI ** -0.5, HI ** -0.5]
                emit({"kernel": "index-prefill-shapes", "S": S, "HI": HI, "DI": DI, "N": N, "ctx": ctx})
                run = lambda: prefill.index_scores(*pre)  # noqa: E731
                unseen = lambda: run().clamp(min=-1e30)  # noqa: E731  (-inf - -inf would read nan)
                sweep(prefill, {"INDEX_ROWS": [64, 128], "INDEX_BLOCK_N": [64, 128], "INDEX_LOOP": [1, 8],
                                "INDEX_WARPS": [4, 8]}, run, emit, f"index-prefill-{ctx}", check=unseen)
                sweep(prefill, {"INDEX_STAGES": [1, 2, 3]}, run, emit, f"index-prefill-stages-{ctx}", check=unseen)
        if "splits" in only:  # how many programs the splits aim for, by itself (it matters at batch > 1)
            sweep(fused, {"SPLIT_WAVES": [1, 2, 3, 4, 8], "ATTN_WARPS": [4, 8]},
                  lambda: fused.sparse_attention(*attn), emit, "sparse_attention-splits")
        if "topk" in only:  # the decode top-k: the radix-select kernel against torch's stable sort, at a step's sizes
            from model.kernels import select
            from model.kernels.reference import top_records

            g = torch.Generator().manual_seed(0)
            for n, k in ((n, 512) for n in (2048, 4096, 8192, 16384, 32768, 65536, 131072)):
                s = ((torch.randn(a.batch, n, generator=g) * 4).round() / 4).to(DEVICE)  # many exact ties
                emit({"kernel": "topk-sort", "n": n, "k": k, "us": round(graphed_us(lambda: top_records(s, k)), 2)})
                sweep(select, {"SELECT_SLICE": [0, 1024, 2048, 4096], "SELECT_WARPS": [4, 8, 16]},
                      lambda: select.topk_rows(s, k), emit, f"topk_rows-{n}-{k}")
        if "indexer" in only:
            sweep(fused, {"INDEX_BLOCK_N": [32, 64, 128], "INDEX_WARPS": [2, 4, 8]},
                  lambda: fused.indexer_scores(*index), emit, "indexer_scores")
        if "mhc" in only:  # one site's mixes: the Sinkhorn split of (2 + hc) * hc numbers a token
            hc = args.hc_mult
            g = torch.Generator().manual_seed(0)
            mixes = torch.randn(a.batch, 1, (2 + hc) * hc, generator=g).to(DEVICE)
            scale, base = torch.rand(3, generator=g).to(DEVICE), torch.randn((2 + hc) * hc, generator=g).to(DEVICE)
            sweep(fused, {"HC_BLOCK_R": [1, 16, 64], "HC_WARPS": [1, 2, 4]},
                  lambda: torch.cat([t.flatten() for t in fused.hc_split(mixes, scale, base, hc,
                                                                         args.hc_sinkhorn_iters, args.hc_eps)]),
                  emit, "hc_split")
        if "site" in only:  # one mHC site, expanded first (the FFN site's form), in bf16
            hc, D = args.hc_mult, args.hidden_size
            g = torch.Generator().manual_seed(0)
            s, y = torch.randn(a.batch, 1, hc, D, generator=g), torch.randn(a.batch, 1, D, generator=g)
            pre, post = torch.rand(a.batch, 1, hc, generator=g), torch.rand(a.batch, 1, hc, generator=g)
            comb = torch.rand(a.batch, 1, hc, hc, generator=g)
            fn = torch.randn((2 + hc) * hc, hc * D, generator=g) / (hc * D) ** 0.5
            scale, base = torch.rand(3, generator=g), torch.randn((2 + hc) * hc, generator=g)
            w = torch.ones(D)
            s, y, w = (t.to(DEVICE, torch.bfloat16) for t in (s, y, w))
            pre, post, comb, fn, scale, base = (t.to(DEVICE) for t in (pre, post, comb, fn, scale, base))
            site = (s, pre, fn, scale, base, w, args.rms_norm_eps, args.rms_norm_eps, args.hc_sinkhorn_iters,
                    args.hc_eps, (y, post, comb))
            flat = lambda out: torch.cat([t.float().flatten() for t in out])  # noqa: E731
            emit({"kernel": "site: parts vs kernel (alone)", "parts_us": round(graphed_us(
                lambda: kernels.hc_site_parts(*site)), 2), "kernel_us": round(graphed_us(lambda: streams.hc_site(*site)), 2),
                "max_abs_diff": (flat(kernels.hc_site_parts(*site)) - flat(streams.hc_site(*site))).abs().max().item()})
            sweep(streams, {"SITE_BLOCK_C": [16, 32, 64, 128], "SITE_WARPS": [1, 2, 4, 8]},
                  lambda: flat(streams.hc_site(*site)), emit, "hc_site")
            sweep(streams, {"FINISH_WARPS": [None, 1, 2, 4, 8]}, lambda: flat(streams.hc_site(*site)), emit,
                  "hc_site-finish")
        if {"gemv", "gemv-sweep"} & set(only):  # a layer's decode projections: cuBLAS (the twin) vs the GEMV
            D, H, hd, r, og = args.hidden_size, args.num_attention_heads, args.head_dim, args.q_lora_rank, args.o_groups
            bf = functools.partial(scaled_bf16, torch.Generator().manual_seed(0), DEVICE)

            x, q_res, heads = bf(a.batch, D), bf(a.batch, r), bf(a.batch, H * hd)
            o_lat = bf(a.batch, og * args.o_lora_rank)

            def one_set() -> dict:
                return {"wq_a+wkv": (x, (bf(r, D), bf(hd, D)), 1), "wq_b": (q_res, (bf(H * hd, r),), 1),
                        "wo_a": (heads, (bf(og * args.o_lora_rank, H * hd // og),), og),
                        "wo_b": (o_lat, (bf(D, og * args.o_lora_rank),), 1),
                        "index wq_b": (q_res, (bf(args.index_n_heads * args.index_head_dim, r),), 1),
                        "weights_proj": (x, (bf(args.index_n_heads, D),), 1)}

            # a graph's CALLS calls each read their own copy of the weights (~30 MB a set at small,
            # 600 MB in all): one weight replayed would sit in the 50 MB L2, which a step, streaming
            # every layer's, never sees
            sets = [one_set() for _ in range(CALLS)]
            next_set = cycling(sets)

            def cycled(fn, name=None):
                def call():
                    layers = next_set()
                    chosen = [layers[name]] if name else layers.values()
                    return torch.cat([o.flatten() for xs, ws, gr in chosen for o in fn(xs, *ws, groups=gr)])
                return call

            for name, (xs, ws, groups) in sets[0].items():
                emit({"kernel": f"gemv: {name}", "weight_bytes": sum(w.numel() * 2 for w in ws),
                      "cublas_us": round(graphed_us(cycled(kernels.gemv_ref, name)), 2),
                      "gemv_us": round(graphed_us(cycled(matvec.gemv, name)), 2),
                      # the same weight every call: it sits in the L2 (the ceiling a prefetch could reach)
                      "gemv_hot_us": round(graphed_us(lambda: matvec.gemv(xs, *ws, groups=groups)[0]), 2),
                      "max_abs_diff": max((p - q).float().abs().max().item() for p, q in zip(
                          kernels.gemv_ref(xs, *ws, groups=groups), matvec.gemv(xs, *ws, groups=groups)))})
            emit({"kernel": "gemv: a layer's six calls", "cublas_us": round(graphed_us(cycled(kernels.gemv_ref)), 2),
                  "gemv_us": round(graphed_us(cycled(matvec.gemv)), 2)})
            if "gemv-sweep" in only:
                first = lambda: torch.cat([o.flatten() for xs, ws, gr in sets[0].values()  # noqa: E731
                                           for o in matvec.gemv(xs, *ws, groups=gr)])
                sweep(matvec, {"TILE_BYTES": [8192, 16384, 32768], "GEMV_WARPS": [4, 8], "MIN_PROGRAMS": [128, 256]},
                      cycled(matvec.gemv), emit, "gemv (a layer's six calls)", check=first)
        if "gate" in only:  # the router alone at the preset's whole width: its weight is read whole every step
            g = torch.Generator().manual_seed(5)
            E, D = whole.n_routed_experts, whole.hidden_size
            gate_w = (torch.randn(E, D, generator=g) * D ** -0.5).to(DEVICE)
            xs = [torch.randn(a.batch, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(CALLS)]
            next_x, bias = cycling(xs), torch.zeros(E, device=DEVICE)
            routing = dict(top_k=whole.num_experts_per_tok, scoring=whole.scoring_func, temp=whole.gate_temp,
                           norm=whole.norm_topk_prob, scale=whole.routed_scaling_factor)
            gate = lambda: moe.route(next_x(), gate_w, bias, {}, **routing)  # noqa: E731
            emit({"kernel": "gate-shapes", "experts": E, "hidden": D, "weight_bytes": gate_w.numel() * 4})
            sweep(moe, {"GATE_ROWS": [16, 32, 64, 512], "GATE_BLOCK_D": [128, 256], "GATE_SPLITS": [16, 32, 64],
                        "GATE_TOPK_WARPS": [1, 4]},
                  gate, emit, "moe-gate", check=lambda: moe.route(xs[0], gate_w, bias, {}, **routing)[1])
        if {"moe", "grouped", "compare", "down", "up", "up-loop", "rows"} & set(only):  # compare: the two forms' times alone
            tensors, config = moe_inputs(args, a.batch, DEVICE, a.ranks)
            if a.fp4:
                tensors, config = fp4_experts(tensors, config)
            by_pair = lambda: moe.moe_decode(*tensors, **config, grouped=False)  # noqa: E731
            grouped = lambda: moe.moe_decode(*tensors, **config, grouped=True)  # noqa: E731
            # the experts picked: the bias is zero and every score function is monotonic in the logit
            chosen = (tensors[0].float() @ tensors[1].float().T).topk(args.num_experts_per_tok).indices
            emit({"kernel": "moe: by pair vs grouped", "distinct_experts": int(chosen.unique().numel()),
                  # bf16 bytes of the experts this rank reads: its chosen ones, its shared channels
                  "active_bytes": 2 * 3 * args.hidden_size * (args.moe_intermediate_size * int(
                      (chosen < tensors[3].shape[0]).sum()) + tensors[6].shape[0]),
                  "by_pair_us": round(graphed_us(by_pair), 2), "grouped_us": round(graphed_us(grouped), 2),
                  "max_abs_diff": (by_pair() - grouped()).abs().max().item()})
        def cycled_moe(seed: int):
            """A moe_decode by pair whose graph's calls each route their own tokens, so they pick
            other experts and read them from HBM, as a step's layers do (one call's 66 MB replayed
            would sit partly in the 50 MB L2)."""
            g = torch.Generator().manual_seed(seed)
            next_x = cycling([torch.randn(tensors[0].shape, generator=g).to(DEVICE, tensors[0].dtype)
                              for _ in range(CALLS)])
            return lambda: moe.moe_decode(next_x(), *tensors[1:], **config, grouped=False)

        if "down" in only:  # the down sum slot by slot against every slot's rows at once (DOWN_SLOTS)
            cycled = cycled_moe(1)
            emit({"kernel": "moe: down slot by slot vs every slot at once (whole MoE, experts cycled)",
                  "slot_by_slot_us": round(with_settings(moe, {"DOWN_SLOTS": False}, lambda: graphed_us(cycled)), 2),
                  "at_once_us": round(with_settings(moe, {"DOWN_SLOTS": True}, lambda: graphed_us(cycled)), 2),
                  "max_abs_diff": (with_settings(moe, {"DOWN_SLOTS": False}, by_pair)
                                   - with_settings(moe, {"DOWN_SLOTS": True}, by_pair)).abs().max().item()})
            with_settings(moe, {"DOWN_SLOTS": True}, lambda: sweep(
                moe, {"SLOTS_BLOCK_O": [2, 4, 8, 16], "SLOTS_BLOCK_I": [128, 256, 512, 1024], "SLOTS_WARPS": [4, 8]},
                cycled, emit, "moe-down-slots", check=by_pair))
            # the slot-by-slot form's tiles
            with_settings(moe, {"DOWN_SLOTS": False}, lambda: sweep(
                moe, {"DOWN_BLOCK_O": [2, 4, 8, 16], "DOWN_BLOCK_I": [128, 256, 512, 1024], "DOWN_WARPS": [4, 8]},
                cycled, emit, "moe-down-by-slot", check=by_pair))
            # the ids and whole tile asked for before the wait (DOWN_EARLY: BLOCK_I is the whole width; bf16 only)
            with_settings(moe, {"DOWN_SLOTS": True}, lambda: sweep(
                moe, {"DOWN_EARLY": [False, True], "SLOTS_BLOCK_O": [1, 2, 4], "SLOTS_WARPS": [4, 8]},
                cycled, emit, "moe-down-early", check=by_pair))
        if "rows" in only:  # FP4 experts by pair (--fp4): the row kernels' tiles, each kernel apart
            sweep(moe, {"ROWS_UP_I": [2, 4, 8], "ROWS_UP_B": [256, 512, 1024], "ROWS_UP_WARPS": [1, 2, 4]},
                  cycled_moe(5), emit, "moe-rows-up", check=by_pair)
            sweep(moe, {"ROWS_DOWN_O": [4, 8, 16, 32], "ROWS_DOWN_B": [64, 128, 256], "ROWS_DOWN_WARPS": [2, 4, 8]},
                  cycled_moe(6), emit, "moe-rows-down", check=by_pair)
        if "up-loop" in only:  # the channel loop's tile (the form a wide preset's rows take)
            sweep(moe, {"UP_EARLY": [False], "UP_BLOCK_I": [2, 4, 8], "UP_BLOCK_D": [256, 512, 1024],
                        "UP_WARPS": [4, 8]}, cycled_moe(4), emit, "moe-up-loop", check=by_pair)
        if "up" in only:  # the up kernel's rows whole (UP_EARLY: the shared expert's before the wait)
            sweep(moe, {"UP_EARLY": [False, True], "UP_EARLY_BLOCK_I": [1, 2, 4, 8], "UP_WARPS": [4, 8],
                        "UP_EARLY_TILE_BYTES": [16384, 65536]},
                  cycled_moe(2), emit, "moe-up-early", check=by_pair)
        if "moe" in only:  # the two expert kernels apart (each with the other at its default): 36 + 36, not 36 x 36
            sweep(moe, {"UP_BLOCK_I": [4, 8, 16, 32], "UP_BLOCK_D": [128, 256, 512], "UP_WARPS": [2, 4, 8]},
                  by_pair, emit, "moe-up")
            sweep(moe, {"DOWN_BLOCK_O": [4, 8, 16, 32], "DOWN_BLOCK_I": [128, 256, 512], "DOWN_WARPS": [2, 4, 8]},
                  by_pair, emit, "moe-down")
        if "grouped" in only:
            sweep(moe, {"G_UP_BLOCK_I": [16, 32, 64], "G_UP_BLOCK_D": [64, 128, 256], "G_UP_WARPS": [2, 4, 8]},
                  grouped, emit, "moe-grouped-up")
            sweep(moe, {"G_DOWN_BLOCK_O": [16, 32, 64], "G_DOWN_BLOCK_I": [64, 128, 256], "G_DOWN_WARPS": [2, 4, 8]},
                  grouped, emit, "moe-grouped-down")


if __name__ == "__main__":
    main()
