"""A prefill's attention on the cache's bytes (``kernels.sparse_prefill``, taken by
``Attention._packed_window`` / ``_attend_packed`` where the kernels run) against the
reference's float keys and gathered records (``Attention.attend``).

- Twin == reference (always, CI too): the packed path forced on the CPU, where
  ``sparse_prefill`` runs the twin (``sparse_attention_ref`` on the strided views), beside
  every attention call of whole prefills of ``tiny`` in exact and CED modes, in chunks, two
  prefills on one state: the same output to float rounding and the same ring bytes.
- Kernel == twin: random packed windows, positions and selections, on CUDA, else under
  ``TRITON_INTERPRET=1``, else skipped; and on CUDA the lockstep above with the kernel.
"""
from __future__ import annotations

import copy

import pytest
import torch

from model import kernels
from model.args import ModelArgs
from model.engine import Engine, Sampling
from model.kernels import sparse_attention_ref, sparse_prefill, triton_available
from model.loading import build, stand_in_token_map
from model.quant import pack_main, pack_window
from tests.test_kernels import assert_out_close, assert_scores_close, latents

ON_CUDA = torch.cuda.is_available()
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
ARGS = ModelArgs.preset("tiny").replace(sliding_window=32, index_topk=8, candidate_topk_blocks=3,
                                        candidate_block_size=2)


def tiny(device="cpu"):
    model = build(ARGS, seed=5, device=device).eval()
    model.bind_token_map(stand_in_token_map(ARGS))
    return model


def lockstep(model, mode: str, monkeypatch, rtol: float) -> int:
    """Two prefills (in chunks of 48) and three decode steps on the reference path, where every
    attention call is run again on a copy of its cache and step by the packed path, on the
    same inputs: its output must agree within ``rtol`` and the copy's window ring must hold the
    same bytes after. (Whole prefills cannot be compared: a float rounding apart, a layer's
    next FP4 index query may round the other way, and so select another record.) -> calls."""
    from model import block

    calls, real = [], block.Attention.core

    def core(self, x, q_res, q, kv, pos, step, cache, ropes, index_query=None):
        twin_cache, twin_shared = copy.deepcopy(cache), copy.deepcopy(step.shared)
        step.packed_reads = False
        out = real(self, x, q_res, q, kv, pos, step, cache, ropes, index_query)
        shared, step.shared, step.packed_reads = step.shared, twin_shared, True
        try:
            twin = real(self, x, q_res, q, kv, pos, step, twin_cache, ropes, index_query)
        finally:
            step.shared, step.packed_reads = shared, False
        if step.length > 1:
            calls.append(self.layer)
            assert_out_close(twin.float(), out.float(), rtol=rtol, msg=f"layer {self.layer} at {step.start}")
            assert torch.equal(twin_cache.windows[self.layer].data, cache.windows[self.layer].data)
        return out

    monkeypatch.setattr(kernels, "attends_packed", lambda t: False)
    monkeypatch.setattr(block.Attention, "core", core)
    engine = Engine(model, mode=mode, chunk=48)
    state = engine.new_state()
    g = torch.Generator().manual_seed(11)
    for n in (130, 45):
        engine.prefill(state, torch.randint(3, 1000, (1, n), generator=g).to(model.device))
    list(engine.generate(state, Sampling(max_new_tokens=3)))
    return len(calls)


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_packed_prefill_twin_equals_the_reference(mode, monkeypatch) -> None:
    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    layers = ARGS.num_hidden_layers
    calls = lockstep(tiny(), mode, monkeypatch, rtol=1e-5)
    chunks = 3 + 1 if mode == "exact" else None  # 130 = 48 + 48 + 34, then 45
    assert calls == (chunks * layers if chunks else ARGS.decoder_start * 4 + (layers - ARGS.decoder_start) * 2)


def prefill_case(S: int, span: int, H: int, N: int, K: int, *, D: int = 512, seed: int = 0, device="cpu"):
    """Random packed inputs of :func:`sparse_prefill`: some window slots empty (-1), the
    first query with nothing selected, -1s among the rest's selections."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(S, H, D, generator=g) * 3).to(torch.bfloat16)
    window = pack_window(latents(span + S, D, g=g))
    pos = torch.arange(-span, S) + 1000
    pos[torch.rand(span + S, generator=g) < 0.2] = -1
    records = pack_main(latents(N, D, g=g))
    idx = torch.randint(0, N, (S, K), generator=g)
    idx[torch.rand(S, K, generator=g) < 0.3] = -1
    idx[0] = -1
    sink = torch.randn(H, generator=g)
    return [t.to(device) for t in (q, window, pos, records, idx, sink)]


def by_rows(q, window, pos, records, idx, sink, scale):
    """The same attention, one decode-step row per query, from materialised windows."""
    S, span = q.shape[0], window.shape[0] - q.shape[0]
    rows = torch.stack([window[i + 1:i + 1 + span] for i in range(S)])
    valid = torch.stack([pos[i + 1:i + 1 + span] >= 0 for i in range(S)])
    return sparse_attention_ref(q, rows, valid, records.expand(S, -1, -1), idx, sink, scale)


def test_the_twin_reads_each_query_its_own_window() -> None:
    inputs = prefill_case(9, 8, 4, 20, 5)
    out = sparse_prefill(*inputs, 512 ** -0.5)
    torch.testing.assert_close(out, by_rows(*inputs, 512 ** -0.5))
    no_records = sparse_prefill(*inputs[:3], None, None, inputs[5], 512 ** -0.5)
    q, window, pos, _, _, sink = inputs
    empty = torch.zeros(9, 0, dtype=torch.long)
    torch.testing.assert_close(no_records, by_rows(q, window, pos, inputs[3][:0], empty, sink, 512 ** -0.5))


# the last of each: 64 heads, whose bf16 query takes ``prefill``'s wide form (its fp32 one the narrow)
CASES = ([(64, 32, 16, 300, 64), (33, 128, 4, 5, 8), (200, 128, 16, 700, 512), (70, 128, 64, 700, 512)] if ON_CUDA
         else [(9, 8, 4, 20, 5), (5, 8, 64, 20, 40)])


@needs_kernel
@pytest.mark.parametrize("path", ["1", "rows"])
@pytest.mark.parametrize("S,span,H,N,K", CASES)
def test_sparse_prefill_kernel(S, span, H, N, K, path, monkeypatch) -> None:
    """Both kernel paths (``model.kernels.prefill``'s keys decoded once, and the decode
    kernel a query a row) against the reference, a bf16 and an fp32 query."""
    from model.kernels import prefill

    assert prefill.wide_form(H, torch.bfloat16) == (H >= 64) and not prefill.wide_form(H, torch.float32)
    monkeypatch.setenv("DSAGENT_PREFILL_KERNELS", path)
    device = "cuda" if ON_CUDA else "cpu"
    inputs = prefill_case(S, span, H, N, K, device=device)
    ref = by_rows(*inputs, 512 ** -0.5)
    for q in (inputs[0], inputs[0].float()):
        for dtype in (torch.float32, torch.bfloat16):
            out = sparse_prefill(q, *inputs[1:], 512 ** -0.5, out_dtype=dtype)
            assert out.dtype == dtype
            assert_out_close(out.float(), ref, rtol=1e-4 if dtype == torch.float32 else 1e-2)


@needs_kernel
def test_decoded_rows_hold_the_twins_values() -> None:
    """The window entries, records and index keys turned to bf16 rows once a call: the values
    ``unpack_window`` / ``unpack_main`` / ``unpack_index`` give, bit for bit (each exact in bf16)."""
    from model.blockfp import pack_index, unpack_index, unpack_main, unpack_window
    from model.kernels.prefill import decoded_rows

    device = "cuda" if ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(4)
    window, records = pack_window(latents(37, 512, g=g) * 40), pack_main(latents(21, 512, g=g) / 40)
    got = decoded_rows(window.to(device), 512, "window")
    assert torch.equal(got.cpu(), unpack_window(window, 512).bfloat16())
    assert torch.equal(unpack_window(window, 512).bfloat16().float(), unpack_window(window, 512))  # exact in bf16
    assert torch.equal(decoded_rows(records.to(device), 512, "record").cpu(), unpack_main(records, 512).bfloat16())
    assert decoded_rows(records[:0].to(device), 512, "record").shape == (0, 512)
    keys = pack_index(torch.randn(19, 128, generator=g) * 7)
    assert torch.equal(decoded_rows(keys.to(device), 128, "index").cpu(), unpack_index(keys, 128).bfloat16())
    assert torch.equal(unpack_index(keys, 128).bfloat16().float(), unpack_index(keys, 128))


@pytest.mark.skipif(not (ON_CUDA and triton_available()), reason="the pipelined for loop is not the interpreter's")
def test_prefill_pipelining_keeps_the_bits(monkeypatch) -> None:
    """``prefill.STAGES``: the same blocks in the same order, so the same bits at 1 and 3."""
    from model.kernels import prefill

    inputs = prefill_case(*CASES[-1], device="cuda")
    got = []
    for stages in (1, 3):
        monkeypatch.setattr(prefill, "STAGES", stages)
        got.append(sparse_prefill(*inputs, 512 ** -0.5, out_dtype=torch.bfloat16))
    assert torch.equal(got[0], got[1])


@pytest.mark.skipif(not (ON_CUDA and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_packed_prefill_kernel_on_the_gpu(mode, monkeypatch) -> None:
    """bf16 on the GPU: the kernel path against the reference path, layer by layer, to bf16 rounding."""
    assert lockstep(tiny("cuda").to(torch.bfloat16), mode, monkeypatch, rtol=1e-2) > 0


@needs_kernel
def test_indexer_scores_with_a_count_a_row() -> None:
    """A prefill's index scores: every query a row with its own position, the keys one buffer
    read by every row (a stride-0 view); the kernel against the twin."""
    from model.kernels import indexer_scores, indexer_scores_ref
    from model.quant import INDEX_BLOCK, fake_quant_fp4, pack_index

    device = "cuda" if ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    S, HI, DI, N, ratio = 7, 4, 128, 40, 2
    q = fake_quant_fp4(torch.randn(S, HI, DI, generator=g), INDEX_BLOCK).to(device)
    w = torch.randn(S, HI, generator=g).to(device)
    keys = pack_index(torch.randn(1, N, DI, generator=g)).to(device).expand(S, -1, -1)
    pos = torch.arange(60, 60 + S, device=device) + torch.tensor([0, 3, 9, 0, 1, 1, 2], device=device)
    out = indexer_scores(q, w, keys, (pos, ratio), DI ** -0.5, weight_scale=HI ** -0.5)
    ref = indexer_scores_ref(q, w, keys, (pos, ratio), DI ** -0.5, weight_scale=HI ** -0.5)
    assert torch.equal(out.isneginf(), ref.isneginf())
    assert [int(n) for n in (~ref.isneginf()).sum(1)] == [min(N, (int(p) + 1) // ratio) for p in pos]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("path,loop", [("1", None), ("1", (16, 3)), ("rows", None)])
@pytest.mark.parametrize("S,HI,N,ratio", [(7, 4, 40, 2), (37, 16, 150, 1), (5, 64, 70, 2)])
def test_prefill_index_scores(S, HI, N, ratio, path, loop, monkeypatch) -> None:
    """A prefill's index scores (``kernels.prefill_index_scores``): a block of queries against
    a block of keys decoded once (``model.kernels.prefill``), or each query a row, against the
    twin; queries of a block seeing different counts, blocks of keys no query sees, a bf16
    and an fp32 query. ``loop``: a program's keys in steps of 16, three a program, so that a
    program reads some steps, stores others as unseen, and ends past the last key."""
    from model.kernels import indexer_scores_ref, prefill, prefill_index_scores
    from model.quant import INDEX_BLOCK, fake_quant_fp4, pack_index

    monkeypatch.setenv("DSAGENT_PREFILL_KERNELS", path)
    if loop is not None:
        monkeypatch.setattr(prefill, "INDEX_BLOCK_N", loop[0])
        monkeypatch.setattr(prefill, "INDEX_LOOP", loop[1])
    device = "cuda" if ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(S)
    DI = 128
    q = fake_quant_fp4(torch.randn(S, HI, DI, generator=g), INDEX_BLOCK).to(device)
    w = torch.randn(S, HI, generator=g).to(device)
    keys = pack_index(torch.randn(N, DI, generator=g)).to(device)
    pos = (torch.arange(S) * 3 + torch.randint(0, 3, (S,), generator=g)).to(device)  # the last sees < N
    ref = indexer_scores_ref(q, w, keys.expand(S, -1, -1), (pos, ratio), DI ** -0.5, weight_scale=HI ** -0.5)
    assert ref.isneginf().any() and (~ref.isneginf()).any()
    for query in (q, q.bfloat16()):
        out = prefill_index_scores(query, w, keys, pos, ratio, DI ** -0.5, weight_scale=HI ** -0.5)
        assert out.shape == (S, N)
        assert_scores_close(out, ref)


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_the_fast_path_asks_for_packed_reads_in_every_chunk_and_the_replay(mode, monkeypatch) -> None:
    """``decode_step.begin`` (every chunk) and the CED replay set ``Step.packed_reads`` where
    ``kernels.attends_packed``: each attention of several tokens then goes through
    ``kernels.sparse_prefill``; elsewhere none does."""
    from model import block

    model, seen = tiny(), []
    real = block.Attention.core

    def core(self, x, q_res, q, kv, pos, step, cache, ropes, index_query=None):
        seen.append(step.packed_reads)
        return real(self, x, q_res, q, kv, pos, step, cache, ropes, index_query)

    monkeypatch.setattr(block.Attention, "core", core)
    calls = []
    real_prefill = kernels.sparse_prefill
    monkeypatch.setattr(kernels, "sparse_prefill", lambda *a, **k: calls.append(1) or real_prefill(*a, **k))
    for on in (False, True):
        seen.clear(), calls.clear()
        monkeypatch.setattr(kernels, "attends_packed", lambda t: on)
        engine = Engine(model, mode=mode, chunk=48)
        engine.prefill(engine.new_state(), torch.randint(3, 1000, (1, 130), generator=torch.Generator().manual_seed(2)))
        assert seen and all(s == on for s in seen) and len(calls) == (len(seen) if on else 0)


@needs_kernel
def test_one_split_ends_in_the_attention_kernel_with_the_merges_bits(monkeypatch) -> None:
    """With one split a row (a prefill), the attention kernel stores the output itself
    (``fused.FINAL_ONE_SPLIT``): the same bits as its partials through the merge launch."""
    from model.kernels import fused

    monkeypatch.setenv("DSAGENT_PREFILL_KERNELS", "rows")
    device = "cuda" if ON_CUDA else "cpu"
    inputs = prefill_case(9, 8, 4, 20, 5, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        merged = []
        for final in (True, False):
            monkeypatch.setattr(fused, "FINAL_ONE_SPLIT", final)
            merged.append(sparse_prefill(*inputs, 512 ** -0.5, out_dtype=dtype))
        assert merged[0].dtype == dtype and torch.equal(merged[0], merged[1])
