"""Count the SASS of the decode kernels at a preset's shapes, on the CPU (Triton for sm_90).

    TRITON_INTERPRET=1 PYTHONPATH=<triton>:. python3 scripts/sass_census.py [--preset small]
        [--only attention,prefill,gemv,indexer,select,site,moe,moe-fp4]
        [--set fused.ATTN_BLOCKWISE=False,fused.ATTN_WARPS=4]

The kernels' own launch functions run once under Triton's interpreter on random inputs of a
decode step's shapes (the attention over a window and the pool's selected records; a layer's
GEMVs: the query's and K=V latent's projections with the site's norm, the query's with its
norm and RoPE, the grouped output projection with the de-rotation, the last projection; the
indexer's scores and the top-k over the pool; one mHC site; a token's MoE), so
each launch is specialised as the model's is — constexprs, warps, the arguments a GPU takes
as multiples of 16. Then ``gpu_compile_check.py --compile`` builds each for sm_90 with
``DSAGENT_SASS=1``: instructions (a static count, every branch), spill stores and the
commonest opcodes a launch. ``--set`` changes kernel constants first (``model.bench.kernel_knob``
form), to count a variant. A guide to where a kernel's serial chain is instructions, not a
timing: the attention's key decode was found so (2026-12-03, 88b7232).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_compile_check import compile_apart, record  # noqa: E402
from model.args import ModelArgs  # noqa: E402
from model.bench import kernel_knob  # noqa: E402
from model.kernels import bench as kbench  # noqa: E402


def attention_launches(args: ModelArgs) -> None:
    from model.kernels import fused

    attn, _ = kbench._inputs(kbench.decode_shapes(args), "cpu")
    q, window, valid, records, idx, sink, scale = attn
    W = window.shape[1]
    at = torch.arange(W, dtype=torch.long)  # every slot live, the query after them: the model's FROM_POS form
    fused.sparse_attention(q, window, None, records, idx, sink.bfloat16(), scale, out_dtype=torch.bfloat16,
                           window_at=(at, torch.tensor([W - 1]), args.sliding_window))


def prefill_launches(args: ModelArgs) -> None:
    """A prefill's attention and index scores (``model.kernels.prefill``): 64 bf16 queries,
    their window, 512 of 2,048 records each; their scores over 2,048 index keys."""
    from model.blockfp import pack_index, pack_main, pack_window
    from model.kernels import prefill

    g = torch.Generator().manual_seed(0)
    S, H, D, span, N = 64, args.num_attention_heads, args.head_dim, args.sliding_window, 2048
    prefill.sparse_prefill(torch.randn(S, H, D, generator=g).bfloat16(), pack_window(torch.randn(span + S, D, generator=g)),
                           torch.arange(span + S), pack_main(torch.randn(N, D, generator=g)),
                           torch.stack([torch.randperm(N, generator=g)[:args.index_topk] for _ in range(S)]),
                           torch.randn(H, generator=g), D ** -0.5, out_dtype=torch.bfloat16)
    HI, DI = args.index_n_heads, args.index_head_dim
    prefill.index_scores(torch.randn(S, HI, DI, generator=g).bfloat16(), torch.randn(S, HI, generator=g),
                         pack_index(torch.randn(N, DI, generator=g)), torch.arange(S) + 2 * N - S, 2, DI ** -0.5)


def gemv_launches(args: ModelArgs) -> None:
    from model.kernels import matvec

    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()

    D, R, H, HD = args.hidden_size, args.q_lora_rank, args.num_attention_heads, args.head_dim
    groups, rank = args.o_groups, args.o_lora_rank
    half = args.qk_rope_head_dim // 2
    cos, sin = torch.rand(1, half), torch.rand(1, half)
    x = w(1, 1, D)
    matvec.gemv(x, w(R, D), w(R, D), norm=(w(D), 1e-6), keep=True)
    matvec.gemv(w(1, 1, R), w(H * HD, R), norm=(w(R), 1e-6), rope_out=(cos, sin, HD), keep=True)
    matvec.gemv(w(1, 1, H * HD), w(groups * rank, H * HD // groups), groups=groups, rope_in=(cos, -sin, HD))
    matvec.gemv(w(1, 1, groups * rank), w(D, groups * rank))


def site_tensors(args: ModelArgs, seed: int) -> tuple:
    """One token's streams (bf16), the incoming pre, the mixes' projection and the site before's
    post / comb, random."""
    g = torch.Generator().manual_seed(seed)
    hc, D = args.hc_mult, args.hidden_size
    m = (2 + hc) * hc
    return (torch.randn(1, hc, D, generator=g).bfloat16(), torch.rand(1, hc, generator=g),
            torch.randn(m, hc * D, generator=g) * (hc * D) ** -0.5,
            (torch.rand(1, hc, generator=g), torch.rand(1, hc, hc, generator=g)))


def indexer_launches(args: ModelArgs) -> None:
    from model.kernels import fused

    _, index = kbench._inputs(kbench.decode_shapes(args), "cpu")
    fused.indexer_scores(index[0].bfloat16(), *index[1:])  # a decode step's query is bf16


def select_launches(args: ModelArgs) -> None:
    """The top-k of the pool's records (a Reindex layer's selection)."""
    from model.kernels import select

    n = args.candidate_topk_blocks * args.candidate_block_size
    scores = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
    select.topk_rows(scores, args.index_topk)


def site_launches(args: ModelArgs) -> None:
    """One mHC site of a decode step with the layer before's expand folded in and its norm
    left to x's consumer (as ``decode_step._whole_layer`` calls it)."""
    from model.kernels import streams

    streams_, pre, fn, (post, comb) = site_tensors(args, seed=0)
    y = torch.randn(1, args.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    m = fn.shape[0]
    streams.hc_site(streams_, pre, fn, torch.ones(3), torch.zeros(m), torch.ones(args.hidden_size).bfloat16(), 1e-6,
                    1e-6, args.hc_sinkhorn_iters, args.hc_eps, expand=(y, post, comb), norm_later=True)


def moe_launches(args: ModelArgs) -> None:
    """A decode token's MoE (gate logits with the site's norm, gate, up, down). The down sum
    is recorded in its early form (``DOWN_EARLY``), the one form of it the interpreter runs,
    then counted as the committed one: the loop over ``SLOTS_BLOCK_I`` channels."""
    from model.kernels import moe

    g = torch.Generator().manual_seed(0)
    D, E, I = args.hidden_size, args.n_routed_experts, args.moe_intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()

    early = moe.DOWN_EARLY
    moe.DOWN_EARLY = True
    try:
        moe.moe_decode(w(1, D), w(E, D), torch.zeros(E), w(E, I, D), w(E, I, D), w(E, D, I), w(I, D), w(I, D),
                       w(D, I), top_k=args.num_experts_per_tok, scoring="sqrtsoftplus", temp=1.0, norm=True,
                       scale=1.0, limit=10.0, out_dtype=torch.bfloat16, x_norm=(w(D), 1e-6))
    finally:
        moe.DOWN_EARLY = early


def moe_fp4_launches(args: ModelArgs) -> None:
    """:func:`moe_launches` on a packed model's experts: the routed ones FP4 as stored (bytes
    and 1 x 32 scales), the shared one FP8 (128 x 128 scales) — the gate's launches, then the row
    kernels and the slots' sum."""
    from model.kernels import moe

    g = torch.Generator().manual_seed(0)
    D, E, I = args.hidden_size, args.n_routed_experts, args.moe_intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()

    experts, scales = kbench.packed_experts((w(E, I, D), w(E, I, D), w(E, D, I)), (w(I, D), w(I, D), w(D, I)))
    moe.moe_decode(w(1, D), w(E, D), torch.zeros(E), *experts,
                   top_k=args.num_experts_per_tok, scoring="sqrtsoftplus", temp=1.0, norm=True, scale=1.0,
                   limit=10.0, out_dtype=torch.bfloat16, x_norm=(w(D), 1e-6), scales=scales)


def committed_down(launch: dict) -> dict:
    """A recorded early down-sum launch as the committed form builds it."""
    from model.kernels import moe

    if launch["name"] != "_down_slots_kernel" or moe.DOWN_EARLY:
        return launch
    return {**launch, "constants": {**launch["constants"], "EARLY": False, "BLOCK_I": moe.SLOTS_BLOCK_I}}


KINDS = {"attention": attention_launches, "prefill": prefill_launches, "gemv": gemv_launches, "indexer": indexer_launches,
         "select": select_launches, "site": site_launches, "moe": moe_launches,
         "moe-fp4": moe_fp4_launches}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--only", default=",".join(KINDS))
    p.add_argument("--set", default="", help="kernel constants changed first (fused.ATTN_WARPS=4,...)")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run under TRITON_INTERPRET=1: the launches are recorded in the interpreter")
    for knob in filter(None, a.set.split(",")):
        module, name, value = kernel_knob(knob)
        setattr(module, name, value)
    args = ModelArgs.preset(a.preset)
    launches: list = []
    record(launches)
    for kind in a.only.split(","):
        KINDS[kind](args)
    with tempfile.TemporaryDirectory() as tmp:
        built = compile_apart([committed_down(launch) for launch in launches], Path(tmp) / "launches.json",
                              env={"DSAGENT_SASS": "1"})
    sys.exit(built.returncode)


if __name__ == "__main__":
    main()
