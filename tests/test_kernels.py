"""The fused decode kernels (``model.kernels``) against their PyTorch twins, and the twins
against the model's own decode step.

- Twin == model: after a prefill of a tiny model, one decode step's ``Attention.attend``
  and ``Indexer.scores`` are reproduced by ``sparse_attention_ref`` / ``indexer_scores_ref``
  from the cache's packed bytes (ring, records, index keys). Always runs (CI too).
- Kernel == twin: random float latents packed with ``model.quant.pack_*``, over the shapes
  of the brief (B, H, N, K, all-invalid window rows, -1 selections). Runs on CUDA when
  present, else under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) with a smaller
  set of cases, else skips.

Tolerances: the kernels compute in fp32 but round the query / probability side of each
dot to about 2^-20 (see ``model.kernels.fused``) and sum in another order; 1e-4 relative.
"""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os

import pytest
import torch

from model import decode_step as ds
from model.args import ModelArgs
from model.kernels import (hc_split, hc_split_ref, indexer_scores, indexer_scores_ref, sparse_attention,
                           sparse_attention_ref, triton_available)
from model.loading import build
from model.quant import INDEX_BLOCK, fake_quant_fp4, main_record_bytes, pack_index, pack_main, pack_window
from model.rope import apply_rope
from tests.interpreted import interpretable

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def assert_out_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4, msg: str | None = None) -> None:
    """Attention outputs: ``rtol`` per element, plus 0.1 * rtol of the largest value for the
    small ones (the kernels' ~2^-20 rounding is relative to the whole sum)."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.1 * rtol * max(1.0, ref.abs().max().item()), msg=msg)


def on_device(inputs) -> list:
    return [a.to(DEVICE) if torch.is_tensor(a) else a for a in inputs]


def assert_scores_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    """Same -inf pattern; finite values within ``rtol`` of the largest one."""
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    scale = ref[fin].abs().max().item() if fin.any() else 1.0
    torch.testing.assert_close(out[fin], ref[fin], rtol=rtol, atol=rtol * max(scale, 1e-3))


# ----------------------------------------------------------------------------- twin == model

def tiny_net():
    """The tiny preset without Engram (no tokenizer needed; attention does not depend on it)
    and with a candidate pool of 2 blocks x 4 = 8 records, fewer than top-k 16, so the
    Reindex layer and its Reuse layer select -1 in their top-k."""
    args = ModelArgs.preset("tiny").replace(engram_layer_ids=(), engram_num_embeddings=(), candidate_topk_blocks=2)
    return build(args).eval()


def capture_decode(net, prefill: int, batch: int = 2, seed: int = 0):
    """Prefill ``prefill`` tokens, then run one decode step while recording, per layer, the
    query and output of ``attend``, the top-k it gathered, and the indexer's inputs and scores
    (the model's reference path: its own use of the kernels is turned off here)."""
    ids = torch.randint(3, net.args.vocab_size, (batch, prefill + 1), generator=torch.Generator().manual_seed(seed))
    cache = net.new_cache(batch)
    seen = {i: {} for i in range(net.args.num_hidden_layers)}
    with torch.no_grad(), _kernels_off():
        net(ids[:, :prefill], cache)
        for i, block in enumerate(net.layers):
            _wrap(block.attn, seen[i])
        try:
            net(ids[:, prefill:], cache)
        finally:
            for block in net.layers:
                vars(block.attn).pop("attend")
                vars(block.attn).pop("_selected_records")
                if block.attn.indexer is not None:
                    vars(block.attn.indexer).pop("scores")
    return cache, seen


@contextlib.contextmanager
def _kernels_off():
    before = os.environ.get("DSAGENT_KERNELS")
    os.environ["DSAGENT_KERNELS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DSAGENT_KERNELS"]
        else:
            os.environ["DSAGENT_KERNELS"] = before


@needs_kernel
def test_model_decode_runs_the_kernels_and_matches_its_reference_path(monkeypatch):
    """The wiring in model.model: decode steps on a packed cache go through the kernels
    (counted) and give the reference path's logits. The prefill before runs the reference
    path in both arms (``DSAGENT_PREFILL_KERNELS=0``: its own kernels are compared in
    tests/test_prefill_attention.py, layer by layer, where FP4 roundings cannot flip). Both arms run the
    mHC and RMSNorm twins and the MoE in torch (those kernels run in prefill too, and on a
    random model their last-bit differences flip FP4 roundings and top-k choices; each is
    compared with its twin on its own: below, in tests/test_norm_kernel.py and
    tests/test_moe_kernel.py). Eager steps: a graph's capture would run a layer twice."""
    import model.kernels as kernels

    monkeypatch.setenv("DSAGENT_FUSED_MOE", "0")
    monkeypatch.setenv("DSAGENT_GRAPHS", "0")
    monkeypatch.setenv("DSAGENT_PREFILL_KERNELS", "0")
    real = kernels.hc_split, kernels.rms_norm
    kernels.hc_split = kernels.hc_split_ref
    kernels.rms_norm = lambda x, w, eps, upcast=False: kernels.rms_norm_ref(x.float() if upcast else x, w, eps)
    try:
        _decode_wiring(kernels)
    finally:
        kernels.hc_split, kernels.rms_norm = real


def _decode_wiring(kernels) -> None:
    net = tiny_net().to(DEVICE)
    ids = torch.randint(3, net.args.vocab_size, (2, 160), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    calls = {"attention": 0, "indexer": 0}
    real_attention, real_indexer = kernels.sparse_attention, kernels.indexer_scores

    def counted(name, fn):
        def run(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return run

    logits = {}
    with torch.no_grad():
        for use in (False, True):
            cache = net.new_cache(2)
            if use:
                kernels.sparse_attention = counted("attention", real_attention)
                kernels.indexer_scores = counted("indexer", real_indexer)
            try:
                with (contextlib.nullcontext() if use else _kernels_off()):
                    net(ids[:, :150], cache)
                    assert calls == {"attention": 0, "indexer": 0}  # prefill: the reference path here
                    logits[use] = torch.stack([ds.forward(net, ids[:, t: t + 1], cache)[:, -1] for t in range(150, 153)])
            finally:
                kernels.sparse_attention, kernels.indexer_scores = real_attention, real_indexer
    n = net.args.num_hidden_layers
    assert calls == {"attention": 3 * n, "indexer": 3 * len(net.args.index_source_layer_ids)}
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("norm_later", [False, pytest.param(True, marks=needs_kernel)])
def test_decode_steps_on_the_twins_match_the_reference_path(norm_later, monkeypatch):
    """CPU and GPU alike: the fused decode path on whatever runs here (the PyTorch twins on
    the CPU) — the candidate pool scored as its records alone, their top-k mapped back —
    gives the reference path's logits. The tiny net's pool is 8 records of the 150 its
    ratio-1 layers hold, so the pool decides the Reindex layer's top-k. ``norm_later``
    (where the site kernel runs): each mHC site's norm left to the GEMV or MoE gate after it."""
    if triton_available():
        from model.kernels import streams

        monkeypatch.setattr(streams, "NORM_LATER", norm_later)
    interpretable(monkeypatch)  # the MoE kernels, not their twin, under the interpreter
    monkeypatch.setenv("DSAGENT_GRAPHS", "0")
    net = tiny_net().to(DEVICE)
    ids = torch.randint(3, net.args.vocab_size, (2, 153), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    logits = {}
    with torch.no_grad():
        for fused in (False, True):
            monkeypatch.setattr(ds, "takes_fused", ds.is_decode_step if fused else (lambda x, step, kv: False))
            cache = net.new_cache(2)
            net(ids[:, :150], cache)
            logits[fused] = torch.stack([ds.forward(net, ids[:, t: t + 1], cache)[:, -1] for t in range(150, 153)])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-3, atol=1e-3)


def test_candidate_rows_pick_what_the_mask_picks():
    """The pool as its records (a decode step's form) holds the mask's records, ascending, -1
    after; the top-k of their scores alone, mapped back, is the masked scores' top-k — FP4
    scores with many exact ties (the lower index wins either way), a pinned newest block, a
    row that sees fewer blocks than the pool keeps."""
    from model.csa2 import candidate_blocks, candidate_rows
    from model.kernels.reference import stable_topk

    g = torch.Generator().manual_seed(2)
    scores = fake_quant_fp4(torch.randn(3, 1, 224, generator=g), 32)[..., :203]
    lens = torch.tensor([150])
    scores[..., 150:] = float("-inf")
    scores[2, 0, 20:] = float("-inf")  # 5 visible blocks of 4: fewer than the pool's 8
    mask, rows = candidate_blocks(scores, lens, 8, 4), candidate_rows(scores, lens, 8, 4)
    assert rows.shape == (3, 1, 32) and rows.dtype == torch.int64
    for b in range(3):
        kept = rows[b, 0][rows[b, 0] >= 0]
        assert kept.tolist() == mask[b, 0].nonzero().flatten().tolist()
        assert (rows[b, 0][len(kept):] == -1).all()
    assert (mask[:, 0, 148:150]).all()  # the newest record's block is pinned
    values, want = stable_topk(scores.masked_fill(~mask, float("-inf")), 16)
    want = want.masked_fill(values == float("-inf"), -1)
    pooled = scores.gather(-1, rows.clamp_min(0)).masked_fill(rows < 0, float("-inf"))
    values, picked = stable_topk(pooled, 16)
    assert torch.equal(rows.gather(-1, picked).masked_fill(values == float("-inf"), -1), want)
    assert (want[2, 0] == -1).sum() == 0 and (want[2, 0] < 20).all()


def test_indexer_scores_at_rows_are_those_of_the_whole_buffer():
    """``rows``: the twin's scores of the keys at those rows are the whole buffer's scores
    there, -inf at -1 and at rows not yet visible."""
    q, w, keys = index_case(2, 16, 300, seed=5)
    rows = torch.tensor([[0, 7, 299, 150, -1, 42], [298, -1, -1, 3, 4, 5]], device=q.device)
    whole = indexer_scores_ref(q, w, keys, 290, 128 ** -0.5)
    want = whole.gather(1, rows.clamp_min(0)).masked_fill(rows < 0, float("-inf"))
    got = indexer_scores_ref(q, w, keys, 290, 128 ** -0.5, rows)
    assert_scores_close(got, want)  # the same sums, batched otherwise: fp32 rounding
    assert torch.isinf(got[0, 2]) and torch.isinf(got[1, 0])  # rows 299 and 298: not visible


def _wrap(attn, seen: dict) -> None:
    """Instance attributes shadow the methods, so only this model's modules record."""
    attend, select = attn.attend, attn._selected_records

    def _attend(q, keys, key_mask, records):
        seen["q"], seen["out"] = q, attend(q, keys, key_mask, records)
        return seen["out"]

    def _selected_records(cache, step):
        seen["topk"] = step.shared.get("topk")
        return select(cache, step)

    attn.attend, attn._selected_records = _attend, _selected_records
    if attn.indexer is not None:
        scores = attn.indexer.scores

        def _scores(*args):
            seen["index_args"], seen["index_scores"] = args, scores(*args)
            return seen["index_scores"]

        attn.indexer.scores = _scores


@torch.no_grad()
def attention_inputs(net, cache, seen: dict, layer: int, t: int):
    """The kernel's inputs for layer ``layer`` at decode position ``t``, read from the cache."""
    args, attn = net.args, net.layers[layer].attn
    ring = cache.windows[layer]
    B = ring.data.shape[0]
    pos = ring.pos
    valid = ((pos >= 0) & (pos <= t) & (pos > t - args.sliding_window)).expand(B, -1)
    if args.ratios[layer] and seen.get("topk") is not None:
        records, idx = cache.sources[args.kv_source(layer)].view()[0], seen["topk"][:, 0]
    else:
        records, idx = ring.data.new_zeros(B, 0, main_record_bytes(attn.head_dim)), torch.zeros(B, 0, dtype=torch.long)
    return seen["q"][:, 0], ring.data, valid, records, idx, attn.attn_sink.detach(), attn.head_dim ** -0.5


@torch.no_grad()
def index_inputs(net, cache, seen: dict, layer: int, t: int):
    """The kernel's inputs for the indexer of ``layer``: q and weights rebuilt the model's way
    from the captured arguments of ``Indexer.scores``, and the source's packed keys."""
    ix, args = net.layers[layer].attn.indexer, net.args
    x, q_res, step, _, inv_freq, kv = seen["index_args"][:6]  # no precomputed query here (not graphed)
    B = x.shape[0]
    q = ix.wq_b(q_res).view(B, 1, ix.n_heads, ix.head_dim)
    q = kv.index_query(apply_rope(q, step.positions(x.device), inv_freq))
    w = ix.weights_proj(x).float() * ix.n_heads ** -0.5
    keys = cache.sources[args.kv_source(layer)].view()[1]
    return q[:, 0].float(), w[:, 0], keys, (t + 1) // args.ratios[layer], ix.head_dim ** -0.5


@pytest.fixture(scope="module", params=[20, 149], ids=["prefill20", "prefill149"])
def decoded(request):
    """prefill20: fewer visible records than top-k (the top-k is shorter); prefill149: the
    ring has wrapped, so some of its slots hold positions outside the window."""
    net = tiny_net()
    cache, seen = capture_decode(net, request.param)
    return net, cache, seen, request.param


def test_sparse_attention_twin_matches_attend(decoded) -> None:
    net, cache, seen, t = decoded
    for layer in range(net.args.num_hidden_layers):
        ref = sparse_attention_ref(*attention_inputs(net, cache, seen[layer], layer, t))
        torch.testing.assert_close(ref, seen[layer]["out"][:, 0], rtol=1e-5, atol=1e-6, msg=f"layer {layer}")


def test_indexer_twin_matches_scores(decoded) -> None:
    net, cache, seen, t = decoded
    for layer in net.args.index_source_layer_ids:
        ref = indexer_scores_ref(*index_inputs(net, cache, seen[layer], layer, t))
        assert_scores_close(ref, seen[layer]["index_scores"][:, 0], rtol=1e-5)


def test_decode_scenarios_cover_the_masks(decoded) -> None:
    """What the twins must get right shows up: -1 selections, short top-k, out-of-window slots."""
    net, cache, seen, t = decoded
    picks = {layer: s["topk"] for layer, s in seen.items() if s.get("topk") is not None}
    assert any(bool((p < 0).any()) for p in picks.values())
    assert (picks[2].shape[-1] < net.args.index_topk) == (t == 20)
    valid = attention_inputs(net, cache, seen[0], 0, t)[2]
    assert bool(((cache.windows[0].pos >= 0) & ~valid).any()) == (t == 149)


@needs_kernel
def test_kernels_match_the_model(decoded) -> None:
    net, cache, seen, t = decoded
    for layer in range(net.args.num_hidden_layers):
        out = sparse_attention(*on_device(attention_inputs(net, cache, seen[layer], layer, t)))
        assert_out_close(out.cpu(), seen[layer]["out"][:, 0], msg=f"layer {layer}")
    for layer in net.args.index_source_layer_ids:
        out = indexer_scores(*on_device(index_inputs(net, cache, seen[layer], layer, t)))
        assert_scores_close(out.cpu(), seen[layer]["index_scores"][:, 0])


# ----------------------------------------------------------------------------- kernel == twin

def latents(*shape, g: torch.Generator) -> torch.Tensor:
    """Rows of unit RMS (as after the model's RMSNorm, so logits stay O(1) and fp32 keeps
    them well conditioned) whose 32-channel blocks differ in magnitude by up to ~2^±12, so
    scale bytes and e4m3 subnormals vary."""
    mags = torch.exp2(torch.randn(*shape[:-1], shape[-1] // 32, 1, generator=g) * 4)
    x = (torch.randn(*shape[:-1], shape[-1] // 32, 32, generator=g) * mags).flatten(-2)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


def attention_case(B: int, H: int, N: int, K: int, *, W: int = 144, D: int = 512, seed: int = 0,
                   q_dtype=torch.float32):
    """Random inputs; with B=3, row 1 sees no window entry and row 2 selects nothing."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, D, generator=g) * 3).to(q_dtype)
    window = pack_window(latents(B, W, D, g=g))
    valid = torch.rand(B, W, generator=g) < 0.6
    records = pack_main(latents(B, N, D, g=g)) if N else torch.zeros(B, 0, D // 2 + D // 16, dtype=torch.uint8)
    idx = torch.full((B, K), -1, dtype=torch.long)
    for b in range(B):
        pick = torch.randperm(N, generator=g)[:K]
        idx[b, : len(pick)] = pick[torch.randperm(len(pick), generator=g)]
    idx[:, 1::4] = -1
    if B == 3:
        valid[1], idx[2] = False, -1
    sink = torch.randn(H, generator=g)
    return on_device([q, window, valid, records, idx, sink, D ** -0.5])


FULL = list(itertools.product([1, 3], [4, 16], [0, 1, 37, 300], [0, 5, 16, 64]))
# the interpreter runs every program in Python: a subset that still covers each value and edge
INTERPRETED = [(1, 4, 0, 0), (3, 16, 300, 64), (3, 4, 1, 5), (1, 16, 37, 16), (3, 4, 0, 16), (1, 4, 300, 5)]
CASES = FULL if ON_CUDA else INTERPRETED


@needs_kernel
@pytest.mark.parametrize("B,H,N,K", CASES)
def test_sparse_attention_kernel(B, H, N, K) -> None:
    inputs = attention_case(B, H, N, K)
    ref = sparse_attention_ref(*inputs)
    out = sparse_attention(*inputs)
    assert out.shape == (B, H, 512) and out.dtype == torch.float32
    assert_out_close(out, ref)
    if B == 3 and not (N and K):
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # row 1 sees only the sink


@needs_kernel
@pytest.mark.parametrize("splits", [1, 2, 7, 20])
def test_sparse_attention_kernel_splits(splits) -> None:
    """Every way of sharing a row between programs merges to the same softmax: window and
    record blocks in one program's share (2, 7), and splits that get no block at all (20:
    the row has 9 window blocks and 4 record blocks)."""
    inputs = attention_case(3, 16, 300, 64, seed=1)
    ref = sparse_attention_ref(*inputs)
    assert_out_close(sparse_attention(*inputs, splits=splits), ref)


@needs_kernel
def test_sparse_attention_kernel_head_groups() -> None:
    """40 heads: three programs of 16 heads per row, the last one two-thirds masked; int32
    selections (the model's top-k is int64) read the same."""
    inputs = attention_case(1, 40, 37, 16, seed=4)
    inputs[4] = inputs[4].int()
    ref = sparse_attention_ref(*inputs)
    assert_out_close(sparse_attention(*inputs), ref)


@needs_kernel
@pytest.mark.parametrize("peak", [1.0, 30.0], ids=["soft", "peaked"])
def test_sparse_attention_kernel_bf16_query(peak) -> None:
    """bf16 queries (the model's dtype) are upcast exactly on both paths; a peaked softmax
    checks the online rescaling across blocks."""
    inputs = attention_case(3, 16, 300, 64, seed=2, q_dtype=torch.bfloat16)
    inputs[0] = (inputs[0].float() * peak).bfloat16()
    ref = sparse_attention_ref(*inputs)
    assert_out_close(sparse_attention(*inputs), ref, rtol=2e-4)
    # as the model calls it: its bf16 sink read in its own dtype, the output written in bf16
    inputs[5] = inputs[5].bfloat16()
    want = sparse_attention(*inputs[:5], inputs[5].float(), inputs[6])
    assert torch.equal(sparse_attention(*inputs), want)
    out = sparse_attention(*inputs, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())


@needs_kernel
@pytest.mark.parametrize("warps", [4, 8])
def test_sparse_attention_blockwise_keys_are_the_rows(warps, monkeypatch) -> None:
    """The keys decoded a block at a time (``ATTN_BLOCKWISE``: a scale byte once per block, a
    record's codes as int32 words, the window's e4m3 bytes by the hardware's conversion) are
    the whole-row form's, over every byte: window rows hold each e4m3 code but the two NaNs
    under ue8m0 scales of 2^-12..2^12, records each byte of e2m1 pairs under e4m3 scales
    from the subnormal 2^-9 up. Each kind of key alone (the other left out), a query so
    small that the probabilities are even, so every key's value reaches the output: the two
    forms' outputs agree bit for bit."""
    from model.kernels import fused

    D, H = 512, 16
    g = torch.Generator().manual_seed(7)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    window = torch.empty(2, 64, D + D // 32, dtype=torch.uint8)
    window[..., :D] = codes[torch.randint(0, len(codes), (2, 64, D), generator=g)]
    window[..., D:] = torch.randint(127 - 12, 127 + 13, (2, 64, D // 32), generator=g).to(torch.uint8)
    records = torch.empty(2, 96, D // 2 + D // 16, dtype=torch.uint8)
    every_byte = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)]
    records[..., : D // 2] = every_byte.repeat(2, 96, 1)
    records[..., D // 2:] = torch.randint(0x01, 0x60, (2, 96, D // 16), generator=g).to(torch.uint8)
    idx = torch.stack([torch.randperm(96, generator=g)[:64] for _ in range(2)])
    idx[:, 3::7] = -1
    q, sink = torch.randn(2, H, D, generator=g) * 1e-9, torch.randn(H, generator=g)
    monkeypatch.setattr(fused, "ATTN_WARPS", warps)
    for valid, picked in ((torch.rand(2, 64, generator=g) < 0.8, torch.full_like(idx, -1)),  # the window's keys
                          (torch.zeros(2, 64, dtype=torch.bool), idx)):  # the records'
        inputs = on_device([q, window, valid, records, picked, sink, D ** -0.5])
        monkeypatch.setattr(fused, "ATTN_BLOCKWISE", False)
        rows = sparse_attention(*inputs)
        monkeypatch.setattr(fused, "ATTN_BLOCKWISE", True)
        assert torch.equal(sparse_attention(*inputs), rows)
        assert_out_close(rows, sparse_attention_ref(*inputs), rtol=2e-4)


@pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                    reason="needs Triton installed; on a GPU the kernel itself compiles in the tests above")
@pytest.mark.parametrize("blockwise", [False, True])
def test_sparse_attention_kernel_compiles_for_hopper(blockwise, tmp_path) -> None:
    """The attention kernel at the model's decode shape (512 channels, 16 heads, a bf16 query,
    the window tested by position) for sm_90 as a dependent launch: the compiler types both
    key branches of ``_key_block`` (the interpreter runs one at a time) and builds the PTX of
    the dependent launch, with either key decode (``ATTN_BLOCKWISE``)."""
    from tests.hopper import compile_for_hopper

    signature = {"q_ptr": "*bf16", "win_ptr": "*u8", "valid_ptr": "*i64", "rec_ptr": "*u8", "idx_ptr": "*i64",
                 "sink_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "cur_ptr": "*i64",
                 **dict.fromkeys(("H", "W", "N", "K", "SPLITS"), "i32"), "scale": "fp32",
                 **dict.fromkeys(("span", "nW", "NB", "s_qb", "s_qh", "s_wb", "s_wn", "s_vb", "s_rb", "s_rn", "s_ib"),
                                 "i32"),
                 **dict.fromkeys(("D", "BLOCK_H", "BLOCK_N", "Q_PARTS", "FROM_POS", "BLOCKWISE", "PDL", "FINAL", "BF16"),
                                 "constexpr"), "out_ptr": "*fp32"}
    constants = {"D": 512, "BLOCK_H": 16, "BLOCK_N": 16, "Q_PARTS": 1, "FROM_POS": True, "BLOCKWISE": blockwise,
                 "PDL": True, "FINAL": False, "BF16": False}
    r = compile_for_hopper([{"module": "model.kernels.fused", "name": "_sparse_attention_kernel",
                             "signature": signature, "constants": constants,
                             "options": {"launch_pdl": True, "num_warps": 8}}], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@needs_kernel
@pytest.mark.parametrize("B", [1, 3])
def test_sparse_attention_kernel_tests_window_slots_itself(B) -> None:
    """``window_at`` (ring positions, the query's position, the span: how a decode step
    calls it) gives what the same slots passed as ``window_valid`` give, bit for bit, on
    the kernel and the twin path; empty (-1), future and too-old slots are all left out."""
    inputs = attention_case(B, 16, 300, 64, seed=5, q_dtype=torch.bfloat16)
    W = inputs[1].shape[1]
    g = torch.Generator().manual_seed(5)
    at = torch.randint(-1, 260, (W,), generator=g).to(inputs[0].device)
    cur, span = torch.tensor([250], device=at.device), 128
    valid = ((at >= 0) & (at <= cur) & (at > cur - span)).expand(B, -1)
    assert 0 < valid[0].sum() < W - 10  # each kind of slot is there
    want = sparse_attention(inputs[0], inputs[1], valid, *inputs[3:], out_dtype=torch.bfloat16)
    got = sparse_attention(inputs[0], inputs[1], None, *inputs[3:], out_dtype=torch.bfloat16,
                           window_at=(at, cur, span))
    assert torch.equal(got, want)
    ref = sparse_attention_ref(inputs[0], inputs[1], valid, *inputs[3:])
    assert_out_close(got.float(), ref, rtol=1e-2)  # bf16 output


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_attention_turns_its_output_back_as_rope_ref(dtype, monkeypatch) -> None:
    """``turn_back`` = (cos, -sin): the merge launch de-rotates each head's output (its last
    2r channels in adjacent pairs) as ``rope_ref`` turns the plain output — bit for bit, in the
    output's dtype; and the twin path turns its own output alike."""
    import model.kernels as kernels
    from model.kernels import rope_ref

    r = 32  # rotated pairs of each head's 512 channels
    inputs = attention_case(3, 16, 300, 64, seed=8, q_dtype=dtype)
    g = torch.Generator().manual_seed(8)
    angle = torch.rand(1, r, generator=g) * 6
    cos, sin = (t.to(inputs[0].device) for t in (torch.cos(angle), -torch.sin(angle)))
    plain = sparse_attention(*inputs, out_dtype=dtype)
    turned = sparse_attention(*inputs, out_dtype=dtype, turn_back=(cos, sin))
    want = rope_ref(plain[:, None], cos, sin)[:, 0]
    assert turned.dtype == dtype and torch.equal(turned, want)
    assert not torch.equal(turned[..., -2 * r:], plain[..., -2 * r:])
    assert torch.equal(turned[..., :-2 * r], plain[..., :-2 * r])
    monkeypatch.setattr(kernels, "_use_triton", lambda t: False)  # the twin path
    twin = kernels.sparse_attention(*inputs, out_dtype=dtype, turn_back=(cos, sin))
    assert torch.equal(twin, rope_ref(sparse_attention_ref(*inputs).to(dtype)[:, None], cos, sin)[:, 0])
    assert_out_close(twin.float(), turned.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-4)


def index_case(B: int, HI: int, N: int, *, d: int = 128, seed: int = 0, quantised: bool = True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HI, d, generator=g)
    q = fake_quant_fp4(q, INDEX_BLOCK) if quantised else q
    w = torch.randn(B, HI, generator=g) * HI ** -0.5
    keys = pack_index(latents(B, N, d, g=g)) if N else torch.zeros(B, 0, d // 2 + d // 32, dtype=torch.uint8)
    return on_device([q, w, keys])


INDEX_CASES = list(itertools.product([1, 3], [4, 16, 64], [0, 1, 37, 300]))


@needs_kernel
@pytest.mark.parametrize("B,HI,N", INDEX_CASES if ON_CUDA else [(1, 4, 0), (3, 16, 300), (1, 64, 37), (3, 4, 1)])
def test_indexer_kernel(B, HI, N) -> None:
    q, w, keys = index_case(B, HI, N)
    for n_visible in sorted({N, max(0, N - 3), 0}):
        ref = indexer_scores_ref(q, w, keys, n_visible, 128 ** -0.5)
        out = indexer_scores(q, w, keys, n_visible, 128 ** -0.5)
        assert out.shape == (B, N) and out.dtype == torch.float32
        assert_scores_close(out, ref)
        held = torch.tensor([n_visible], device=q.device)  # the count as a graphed step passes it
        assert torch.equal(indexer_scores(q, w, keys, held, 128 ** -0.5), out)
        assert torch.equal(indexer_scores_ref(q, w, keys, held, 128 ** -0.5), ref)
        for ratio in (1, 2):  # a decode step's position, the count made from it, and its weights' scale
            pos = torch.tensor([ratio * (n_visible + 1) - 2], device=q.device)  # (pos + 1) // ratio == n_visible
            scaled = indexer_scores(q, w * HI ** 0.5, keys, (pos, ratio), 128 ** -0.5, weight_scale=HI ** -0.5)
            assert torch.equal(scaled, indexer_scores(q, (w * HI ** 0.5) * HI ** -0.5, keys, n_visible, 128 ** -0.5))
            assert torch.equal(indexer_scores_ref(q, w * HI ** 0.5, keys, (pos, ratio), 128 ** -0.5,
                                                  weight_scale=HI ** -0.5),
                               indexer_scores_ref(q, (w * HI ** 0.5) * HI ** -0.5, keys, n_visible, 128 ** -0.5))


@needs_kernel
@pytest.mark.parametrize("B,HI,N", [(1, 16, 300), (3, 4, 37)])
def test_indexer_kernel_at_rows(B, HI, N) -> None:
    """The kernel's scores of the keys at ``rows`` (a candidate pool's records): the twin's."""
    q, w, keys = index_case(B, HI, N, seed=6)
    g = torch.Generator().manual_seed(6)
    rows = torch.randint(-1, N + 2, (B, 70), generator=g).to(q.device)  # -1, visible, unseen, past the buffer
    for n_visible in (N, N - 5, torch.tensor([N - 9], device=q.device)):
        ref = indexer_scores_ref(q, w, keys, n_visible, 128 ** -0.5, rows)
        out = indexer_scores(q, w, keys, n_visible, 128 ** -0.5, rows)
        assert out.shape == (B, 70)
        assert_scores_close(out, ref)


@needs_kernel
def test_indexer_kernel_unquantised_query() -> None:
    """Any float query works, not only the FP4 grid the model feeds it."""
    q, w, keys = index_case(3, 16, 300, seed=3, quantised=False)
    assert_scores_close(indexer_scores(q, w, keys, 290, 128 ** -0.5), indexer_scores_ref(q, w, keys, 290, 128 ** -0.5))


# ----------------------------------------------------------------------------- mHC mixes

def _mixes(lead: tuple, hc: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mixes = torch.randn(*lead, (2 + hc) * hc, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
    return on_device([mixes, scale, base])


@needs_kernel
@pytest.mark.parametrize("lead,iters", [((1, 1), 20), ((2, 5), 20), ((3, 130), 20), ((1, 7), 1), ((0, 3), 20)])
def test_hc_split_kernel(lead, iters) -> None:
    from model.kernels import fused

    mixes, scale, base = _mixes(lead)
    got = fused.hc_split(mixes, scale, base, 4, iters, 1e-6)
    want = hc_split_ref(mixes, scale, base, 4, iters, 1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if lead[1]:  # Sinkhorn ends on a column normalisation: columns sum to 1 - eps / sum (rows only nearly)
        cols = got[2].sum(-2)
        torch.testing.assert_close(cols, torch.ones_like(cols), rtol=0, atol=1e-3)


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("lead,iters", [((1, 1), 20), ((2, 5), 20), ((3, 130), 7), ((1, 7), 1)])
def test_the_sinkhorn_on_the_host_keeps_the_bits(lead, iters, hc) -> None:
    """``hc_split_ref``'s ``host`` loop (numpy) against its torch loop, bit for bit: mixes
    spread wide (softmax rows near one-hot) and narrow, eps as the configs set it and larger."""
    g = torch.Generator().manual_seed(hc * 100 + iters)
    for spread, eps in ((1.0, 1e-6), (30.0, 1e-6), (0.01, 1e-3)):
        mixes = torch.randn(*lead, (2 + hc) * hc, generator=g) * spread
        scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
        torch_loop = hc_split_ref(mixes, scale, base, hc, iters, eps)
        host_loop = hc_split_ref(mixes, scale, base, hc, iters, eps, host=True)
        for a, b in zip(torch_loop, host_loop):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_a_cpu_decode_steps_mixes_take_the_host_loop(monkeypatch) -> None:
    """On the CPU outside autograd, up to ``SINKHORN_HOST_ROWS`` tokens: the host loop; more
    tokens, or a gradient wanted: torch's."""
    import model.kernels as kernels
    from model.kernels import reference

    if triton_available():
        monkeypatch.setattr(kernels, "enabled", lambda x: False)  # the twin's path, not the kernel's
    taken = []
    real = kernels.hc_split_ref
    monkeypatch.setattr(kernels, "hc_split_ref", lambda *a, host=False: taken.append(host) or real(*a, host=host))
    for tokens in (1, reference.SINKHORN_HOST_ROWS, reference.SINKHORN_HOST_ROWS + 1):
        mixes, scale, base = (t.cpu() for t in _mixes((1, tokens)))
        hc_split(mixes, scale, base, 4, 20, 1e-6)
    scale.requires_grad_(True)
    hc_split(mixes[:, :1], scale, base, 4, 20, 1e-6)
    assert taken == [True, True, False, False]


def test_hc_split_keeps_the_twin_when_a_gradient_is_wanted() -> None:
    """The kernel has no backward: with autograd on a parameter the twin runs (and differentiates)."""
    mixes, scale, base = _mixes((1, 3))
    scale.requires_grad_(True)
    pre, post, comb = hc_split(mixes, scale, base, 4, 20, 1e-6)
    (pre.sum() + post.sum() + comb.square().sum()).backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0


@needs_kernel
def test_model_mixes_run_the_mhc_kernel_outside_autograd(monkeypatch) -> None:
    """A decode step's few tokens: the one-site kernel; more (a prefill chunk): the split
    kernel after torch's projection; with a gradient wanted (training): the twins."""
    from model.kernels import fused, streams

    interpretable(monkeypatch)  # the MoE kernels, not their twin, under the interpreter
    calls = []
    for module, name in ((fused, "hc_split"), (streams, "hc_site")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    net = tiny_net().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    sites = 2 * net.args.num_hidden_layers  # both sites of every layer
    with torch.no_grad():
        net(torch.randint(3, net.args.vocab_size, (1, 9), generator=g).to(DEVICE))
        assert calls == ["hc_site"] * sites
        calls.clear()
        net(torch.randint(3, net.args.vocab_size, (1, 17), generator=g).to(DEVICE))
        assert calls == ["hc_split"] * sites
    calls.clear()
    net(torch.randint(3, net.args.vocab_size, (1, 9), generator=g).to(DEVICE)).sum().backward()
    assert calls == [] and net.layers[0].hc_attn_scale.grad is not None


@needs_kernel
def test_hc_split_falls_back_to_the_twin_when_the_kernel_cannot_build(monkeypatch) -> None:
    import model.kernels as kernels
    from model.kernels import fused, reference

    def broken(*args):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(fused, "hc_split", broken)
    monkeypatch.setattr(kernels, "_FAILED", {})
    mixes, scale, base = _mixes((1, 3))
    with pytest.warns(RuntimeWarning, match="mHC kernel path failed"):
        got = hc_split(mixes, scale, base, 4, 20, 1e-6)
    assert "mHC kernel" in kernels._FAILED and all(torch.equal(a, b) for a, b in zip(got, reference.hc_split_ref(mixes, scale, base, 4, 20, 1e-6)))


@pytest.mark.skipif(not ON_CUDA, reason="the compiled twin is the CUDA training path")
def test_compiled_twin_matches_the_twin_with_gradients() -> None:
    """Training on CUDA runs the mHC mixes through torch.compile: same values and gradients."""
    mixes, scale, base = _mixes((2, 37))
    runs = []
    for compiled in (True, False):
        m, s, b = (t.clone().requires_grad_(True) for t in (mixes, scale, base))
        out = hc_split(m, s, b, 4, 20, 1e-6) if compiled else hc_split_ref(m, s, b, 4, 20, 1e-6)
        sum(o.square().sum() for o in out).backward()
        runs.append((out, (m.grad, s.grad, b.grad)))
    import model.kernels as kernels

    assert "compiled mHC" not in kernels._FAILED
    for got, want in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_twin_pads_rows_to_one_shape_class(monkeypatch) -> None:
    """The compiled twin sees the rows flattened and zero-padded to a multiple of 8,192
    (one graph for every batch shape); the caller gets its own rows back. The
    compiler is replaced by the plain twin here (a compile takes ~90 s on a CPU)."""
    import model.kernels as kernels

    seen = []

    def twin(flat, *rest):
        seen.append(tuple(flat.shape))
        return hc_split_ref(flat, *rest)

    monkeypatch.setattr(kernels, "_compiled_twin", lambda: twin)
    for shape in ((1, 1), (2, 37), (1, 9000)):
        mixes, scale, base = _mixes(shape)
        got = kernels._hc_split_compiled(mixes, scale, base, 4, 20, 1e-6)
        for a, b in zip(got, hc_split_ref(mixes, scale, base, 4, 20, 1e-6)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # other row counts, other vector paths
    assert seen == [(8192, 24), (8192, 24), (16384, 24)]


@pytest.mark.skipif(not ON_CUDA, reason="the compiled twin is the CUDA training path")
def test_compiled_twin_compiles_once_for_every_row_count() -> None:
    """1 row, 74 rows and 9,000 rows run one compiled graph (each new one cost a training
    run 25-96 s of compiling)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for shape in ((1, 1), (2, 37), (1, 9000)):
        mixes, scale, base = (t.requires_grad_(True) for t in _mixes(shape))
        sum(o.sum() for o in hc_split(mixes, scale, base, 4, 20, 1e-6)).backward()
    assert counters["stats"]["unique_graphs"] - before <= 1


# ----------------------------------------------------------------------------- KV packing

def _kv_rows(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Rows with every rounding case: a wide spread of scales per block, exact zeros and -0,
    e4m3 / e2m1 ties (multiples of the grid's half steps) and values deep in subnormals."""
    g = torch.Generator().manual_seed(seed)
    block_scales = torch.exp2(torch.randint(-12, 8, (*shape[:-1], shape[-1] // 16), generator=g).float())
    x = torch.randn(*shape, generator=g) * block_scales.repeat_interleave(16, -1)
    x[..., 0] = 0.0
    x[..., 1] = -0.0
    x[..., 2:10] = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 3.5, -1.75, 1e-30])
    x[..., 16:48] = torch.randint(-64, 64, (*shape[:-1], 32), generator=g).float() / 16  # ties under a power-of-two scale
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("which", ["pack_window", "pack_main", "pack_index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_kernels_write_the_same_bytes(which, dtype) -> None:
    from model import quant
    from model.kernels import pack

    dim = 128 if which == "pack_index" else 512
    for shape in ((3, 5, dim), (1, dim), (64, dim)):
        x = _kv_rows(shape, dtype, seed=len(shape)).to(DEVICE)
        got, want = getattr(pack, which)(x), getattr(quant, which)(x)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert torch.equal(got, want), f"{which} {shape}: {(got != want).sum().item()} bytes differ"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_packs_its_window_entries_into_the_ring(dtype) -> None:
    """``pack_window_at`` (one launch: pack, slot, position) leaves a ring as
    ``WindowRing.write`` does, byte for byte, over steps that wrap the ring."""
    from model.cache import WindowRing
    from model.kernels import pack

    rings = [WindowRing(3, 5, 512, DEVICE) for _ in range(2)]
    for p in range(7):
        kv = _kv_rows((3, 1, 512), dtype, seed=p).to(DEVICE)
        pos = torch.tensor([p], device=DEVICE)
        rings[0].write(kv, pos)
        pack.pack_window_at(kv, rings[1].data, rings[1].pos, pos)
        assert torch.equal(rings[1].data, rings[0].data) and torch.equal(rings[1].pos, rings[0].pos), p
    assert rings[1].pos.tolist() == [5, 6, 2, 3, 4]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_window_entry_is_made_in_one_launch(dtype) -> None:
    """``window_entry`` (norm, RoPE, FP8 values, bytes, slot and position in one launch) leaves
    a ring as the four kernels it replaces do (``rms_norm``, ``rope``, ``fake_quant_fp8``,
    ``pack_window_at``), over steps that wrap the ring. Byte for byte on rows of multiples of
    1/8, whose sums of squares are exact in any order; on Gaussian rows the norm's sum may
    round otherwise, so there nearly every byte, and the values to an FP8 step."""
    from model import kernels, quant
    from model.cache import WindowRing
    from model.kernels import pack

    g = torch.Generator().manual_seed(3)
    weight = (1 + 0.25 * torch.randn(512, generator=g)).to(DEVICE, dtype)
    for exact in (True, False):
        rings = [WindowRing(3, 5, 512, DEVICE) for _ in range(2)]
        for p in range(7):
            kv = torch.randn(3, 1, 512, generator=g) * 4
            kv = (kv * 8).round() / 8 if exact else kv
            kv = kv.to(DEVICE, dtype)
            angle = torch.rand(1, 32, generator=g) * 6
            cos, sin = angle.cos().to(DEVICE), angle.sin().to(DEVICE)
            pos = torch.tensor([p], device=DEVICE)
            entry = kernels.fake_quant_fp8(kernels.rope(kernels.rms_norm(kv, weight, 1e-6), cos, sin))
            pack.pack_window_at(entry, rings[0].data, rings[0].pos, pos)
            pack.window_entry(kv, weight, 1e-6, cos, sin, rings[1].data, rings[1].pos, pos)
            assert torch.equal(rings[1].pos, rings[0].pos), p
            if exact:
                assert torch.equal(rings[1].data, rings[0].data), p
            else:
                assert (rings[1].data != rings[0].data).float().mean().item() < 0.01, p
                got, want = (quant.unpack_window(r.data, 512) for r in rings)
                torch.testing.assert_close(got, want, rtol=2 ** -3, atol=0.0)
        assert rings[1].pos.tolist() == [5, 6, 2, 3, 4]


@needs_kernel
@pytest.mark.parametrize("which", ["window", "main", "index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_kernels_give_the_values_bit_for_bit(which, dtype) -> None:
    """The values the packed bytes decode to (the window's FP8 as attention sees the fresh
    row, the indexer query's FP4): the kernel equals model.quant's fake_quant_* exactly, in
    the input's dtype, -0.0 kept; through the dispatcher as well."""
    from model import kernels, quant
    from model.kernels import pack

    dim, kw = {"window": (512, {}), "main": (512, {"block": 16, "e4m3_scales": True}),
               "index": (128, {"block": INDEX_BLOCK})}[which]
    kernel, twin = ((pack.fake_quant_fp8, quant.fake_quant_fp8) if which == "window"
                    else (pack.fake_quant_fp4, quant.fake_quant_fp4))
    via = kernels.fake_quant_fp8 if which == "window" else kernels.fake_quant_fp4
    for shape in ((3, 5, dim), (1, dim), (2, 3, 4, dim)):
        x = _kv_rows(shape, dtype, seed=len(shape)).to(DEVICE)
        x[..., 1] = -0.0
        got, want = kernel(x, **kw), twin(x, **kw)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
            f"{which} {shape}: {(got != want).sum().item()} values differ"
        assert torch.equal(via(x, **kw), want)
    strided = _kv_rows((4, 2 * dim), dtype).to(DEVICE)[:, ::2]  # not contiguous: rows copied first
    assert torch.equal(kernel(strided, **kw), twin(strided, **kw))


@needs_kernel
def test_qat_training_quantises_through_the_kernels_with_identity_gradients(monkeypatch) -> None:
    """Training's straight-through quantisers take the values from the one-launch kernels
    (the gradient needs no graph through them): FP4 weights (2^k blocks a row; other widths
    the twin), the window's FP8 and the index query's FP4 under KVFormat.TRAIN — the
    values model.quant gives, and the identity's gradient."""
    from model import kernels, quant
    from model.kernels import pack
    from model.training import _WeightQAT

    calls = []
    for name in ("fake_quant_fp4", "fake_quant_fp8"):
        real = getattr(pack, name)
        monkeypatch.setattr(pack, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    g = torch.Generator().manual_seed(3)
    for in_f, kernel_runs in ((128, True), (96, False)):  # 4 blocks of 32; 3 blocks: the twin
        w = (torch.randn(24, in_f, generator=g) * 0.05).to(DEVICE).requires_grad_(True)
        calls.clear()
        q = _WeightQAT("fp4", (1, 32))(w)
        want = quant.fake_quant_fp4(torch.nn.functional.pad(w.detach().float(), (0, -in_f % 32)), 32)[:, :in_f]
        assert torch.equal(q.detach(), want) and calls == (["fake_quant_fp4"] if kernel_runs else [])
        q.square().sum().backward()
        torch.testing.assert_close(w.grad, 2 * q.detach(), rtol=0, atol=0)  # d/dw of q^2 through the identity
    x = _kv_rows((2, 3, 512), torch.float32).to(DEVICE).requires_grad_(True)
    calls.clear()
    y = quant.KVFormat.TRAIN.window(x)
    assert calls == ["fake_quant_fp8"] and torch.equal(y.detach(), quant.fake_quant_fp8(x.detach()))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert "FP4 values" not in kernels._FAILED and "FP8 values" not in kernels._FAILED


def test_kv_formats_pack_through_the_dispatcher() -> None:
    """KVFormat.PACKED packs with model.kernels (kernel or twin), giving model.quant's bytes."""
    from model import quant
    from model.quant import KVFormat

    x = _kv_rows((2, 512), torch.float32)
    assert torch.equal(KVFormat.PACKED.pack_main(x), quant.pack_main(x))
    assert torch.equal(KVFormat.PACKED.pack_window(x), quant.pack_window(x))
    assert torch.equal(KVFormat.PACKED.pack_index(x[:, :128]), quant.pack_index(x[:, :128]))


@needs_kernel
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compressor_step_is_made_in_four_launches(ratio, dtype) -> None:
    """``kernels.compress_step`` (the projections' GEMV, the ring, the pooled latent and its
    record, the index key's GEMV and its key: four launches) leaves a KV source as
    ``decode_step.compressor_step`` and the packs of ``decode_step._compress`` leave it, over steps at
    every phase of a group: the history ring's positions bit for bit, its projections to
    rounding (the GEMV sums in another order); the records and index keys whose bytes
    nearly all agree (the GEMVs, the pool's exp and the norms' sums round otherwise, so a
    value on an FP4 boundary may flip), their values to half an FP4 step of the largest."""
    from model import quant
    from model.cache import SourceKV
    from model.rope import Ropes, apply_rope

    args = ModelArgs.preset("tiny").replace(compress_ratios=(0, 0) + (ratio,) * 4 + (1,) * 4)
    attn = build(args, seed=5, device=DEVICE, dtype=dtype).eval().layers[2].attn
    comp, index, ropes = attn.compressor, attn.indexer, Ropes(args).to(DEVICE)
    sources = [SourceKV(2, ratio, args.head_dim, args.index_head_dim, DEVICE) for _ in range(2)]
    x = torch.randn(2, 9, args.hidden_size, generator=torch.Generator().manual_seed(ratio)).to(DEVICE, dtype)
    with torch.no_grad():
        for t in range(9):
            pos, emits = torch.tensor([t], device=DEVICE), (t + 1) % ratio == 0
            for src in sources:
                src.reserve(t)
            assert ds._compress_kernels(attn, x[:, t:t + 1], pos, sources[0], emits, ropes)
            made = ds.compressor_step(comp, x[:, t:t + 1], pos, sources[1], emits)
            if made is not None:
                latent, first = made
                sources[1].write_at(first // ratio, quant.pack_main(apply_rope(latent, first, ropes.compress)),
                                    index.keys(latent, first, ropes.compress, quant.KVFormat.PACKED))
            for src in sources:
                src.stepped(t)
    ours, theirs = sources
    assert torch.equal(ours.hist_pos, theirs.hist_pos)
    for name in ("hist_kv", "hist_gate"):  # the GEMV sums in another order than torch's linear
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-5, atol=1e-5)
    n = 9 // ratio
    for name, unpack, dim in (("records", quant.unpack_main, args.head_dim),
                              ("index", quant.unpack_index, args.index_head_dim)):
        got, want = getattr(ours, name)[:, :n], getattr(theirs, name)[:, :n]
        assert want.any() and (got != want).float().mean().item() < 0.02, name
        torch.testing.assert_close(unpack(got, dim), unpack(want, dim), rtol=0.0, atol=0.5 * unpack(want, dim).abs().max().item() / 6)
