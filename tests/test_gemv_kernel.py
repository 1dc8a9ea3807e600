"""The decode GEMV kernel (``model.kernels.matvec``) against its twin ``gemv_ref`` (``F.linear``,
and the grouped output projection's einsum), and the model's linear layers on it.

Runs on CUDA when present, else under ``TRITON_INTERPRET=1``, else skips. Tolerances: the
kernel sums its products in another order than the GEMM, so fp32 agrees to ~1e-6 relative
and bf16 to one bf16 step (2^-8) of an output.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import model.kernels as kernels
from model.args import ModelArgs
from model import decode_step as ds
from model.block import Attention
from model.linear import Linear
from tests.hopper import compile_for_hopper

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not kernels.triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * shape[-1] ** -0.5).to(DEVICE, dtype)


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-5 if out.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_dim,in_dim", [(1, 512, 2048), (3, 16, 2048), (2, 37, 300), (4, 2048, 512)])
def test_gemv_matches_linear(dtype, rows, out_dim, in_dim):
    """Widths from `small`'s projections, plus an odd output and input width (masked tails)."""
    x, w = rand(rows, 1, in_dim, seed=1, dtype=dtype), rand(out_dim, in_dim, seed=2, dtype=dtype)
    (out,) = kernels.gemv(x, w)
    close(out, torch.nn.functional.linear(x, w))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_of_two_weights_in_one_launch(dtype):
    """The query's and the K=V latent's projections of one x: each output as its own linear."""
    x = rand(2, 1, 256, seed=3, dtype=dtype)
    wa, wb = rand(64, 256, seed=4, dtype=dtype), rand(96, 256, seed=5, dtype=dtype)
    a, b = kernels.gemv(x, wa, wb)
    close(a, torch.nn.functional.linear(x, wa))
    close(b, torch.nn.functional.linear(x, wb))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemv_reads_only_its_groups_channels(dtype):
    """4 groups: output group j is weight rows of group j against x's channels of group j —
    as the grouped einsum; a block that read another group's channels would be off by a
    whole product."""
    x, w = rand(2, 1, 4 * 128, seed=6, dtype=dtype), rand(4 * 64, 128, seed=7, dtype=dtype)
    (out,) = kernels.gemv(x, w, groups=4)
    (ref,) = kernels.gemv_ref(x, w, groups=4)
    close(out, ref)
    explicit = torch.cat([torch.nn.functional.linear(x[..., j * 128:(j + 1) * 128], w[j * 64:(j + 1) * 64])
                          for j in range(4)], -1)
    close(out, explicit)


def angles(S: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(S, half, generator=torch.Generator().manual_seed(seed)) * 6.0
    return a.cos().to(DEVICE), a.sin().to(DEVICE)


def as_heads(t: torch.Tensor, cos, sin, hd: int) -> torch.Tensor:
    """``rope_ref`` of t [B, S, heads * hd] seen as heads: what the GEMV's rotations compute."""
    return kernels.rope_ref(t.view(*t.shape[:2], -1, hd), cos, sin).view(t.shape)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rotates_its_output_as_the_rope_after_it(dtype):
    """``rope_out``: the output's heads rotated in the kernel's last lines are bit for bit the
    GEMV's plain output rotated by ``rope_ref`` (the same fp32 products and sums, each rounded
    on its own), at 2 rows x 2 positions and at one position, 4 heads of 64 with 16 pairs
    rotated; and they agree with the twin."""
    from model.kernels import matvec

    for B, S in ((2, 2), (1, 1)):
        x, w = rand(B, S, 256, seed=20, dtype=dtype), rand(4 * 64, 256, seed=21, dtype=dtype)
        cos, sin = angles(S, 16, seed=22)
        (rotated,) = matvec.gemv(x, w, rope_out=(cos, sin, 64))
        (plain,) = matvec.gemv(x, w)
        assert torch.equal(rotated, as_heads(plain, cos, sin, 64))
        assert not torch.equal(rotated, plain)
        close(rotated, kernels.gemv_ref(x, w, rope_out=(cos, sin, 64))[0])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemv_rotates_its_input_first(dtype):
    """``rope_in`` (the attention output de-rotated before ``wo_a``): bit for bit the grouped
    GEMV of x rotated by ``rope_ref`` first; 4 groups of 2 heads of 64 channels."""
    from model.kernels import matvec

    x, w = rand(2, 1, 8 * 64, seed=23, dtype=dtype), rand(4 * 32, 2 * 64, seed=24, dtype=dtype)
    cos, sin = angles(1, 16, seed=25)
    (out,) = matvec.gemv(x, w, groups=4, rope_in=(cos, -sin, 64))
    assert torch.equal(out, matvec.gemv(as_heads(x, cos, -sin, 64), w, groups=4)[0])
    close(out, kernels.gemv_ref(x, w, groups=4, rope_in=(cos, -sin, 64))[0])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_normalises_its_input_first(dtype):
    """``norm`` (the query's RMSNorm before ``wq_b``): as the GEMV of the RMSNorm kernel's
    output, to rounding (the row's sum of squares may be reduced in another order), and the
    twin; with ``rope_out`` too, as the query's projection runs."""
    from model.kernels import matvec

    x, w = rand(3, 1, 512, seed=26, dtype=dtype) * 7.0, rand(2 * 128, 512, seed=27, dtype=dtype)
    nw = (1 + 0.1 * torch.randn(512, generator=torch.Generator().manual_seed(28))).to(DEVICE, dtype)
    (out,) = matvec.gemv(x, w, norm=(nw, 1e-6))
    close(out, matvec.gemv(kernels.rms_norm(x, nw, 1e-6), w)[0])
    close(out, kernels.gemv_ref(x, w, norm=(nw, 1e-6))[0])
    cos, sin = angles(1, 32, seed=29)
    (both,) = matvec.gemv(x, w, norm=(nw, 1e-6), rope_out=(cos, sin, 128))
    close(both, kernels.gemv_ref(x, w, norm=(nw, 1e-6), rope_out=(cos, sin, 128))[0])


@needs_triton
def test_gemv_runs_only_when_asked_on_a_few_rows_outside_autograd(monkeypatch):
    w = torch.nn.Linear(64, 32, bias=False).to(DEVICE)
    monkeypatch.delenv("DSAGENT_GEMV", raising=False)
    with torch.no_grad():
        assert kernels.gemv_runs(rand(1, 64, seed=9), w)  # on by default
        monkeypatch.setenv("DSAGENT_GEMV", "1")
        assert kernels.gemv_runs(rand(kernels.GEMV_TOKENS, 64, seed=9), w)
        assert not kernels.gemv_runs(rand(kernels.GEMV_TOKENS + 1, 64, seed=9), w)  # a prefill chunk: cuBLAS
        assert not kernels.gemv_runs(rand(1, 64, seed=9, dtype=torch.bfloat16), w)  # dtypes differ
        monkeypatch.setenv("DSAGENT_GEMV", "0")
        assert not kernels.gemv_runs(rand(1, 64, seed=9), w)
    monkeypatch.setenv("DSAGENT_GEMV", "1")
    assert not kernels.gemv_runs(rand(1, 64, seed=9), w)  # gradients on: torch


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_projections_on_the_gemv(dtype, monkeypatch):
    """A decode step's query / K=V projections and the grouped output projection of the
    tiny preset's attention, through the GEMV (``DSAGENT_GEMV=1``: four launches), against
    the same layer with ``DSAGENT_GEMV=0``. The two weights of the first launch have blocks
    of different heights here (1 and 2 rows), the case that once failed to compile on the GPU."""
    from model.rope import Ropes
    from model.quant import KVFormat

    args = ModelArgs.preset("tiny")
    g = torch.Generator().manual_seed(0)
    attn = Attention(args, layer=0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn(
                p.shape, generator=g))
    attn = attn.to(DEVICE, dtype).eval()
    ropes = Ropes(args).to(DEVICE)
    x = rand(2, 1, args.hidden_size, seed=10, dtype=dtype)
    out = rand(2, 1, args.num_attention_heads, args.head_dim, seed=11, dtype=dtype)
    pos = torch.tensor([5], device=DEVICE)
    fmt = KVFormat.FLOAT  # the window entries as floats: the projections alone are compared
    monkeypatch.setenv("DSAGENT_GEMV", "1")
    calls = []
    real = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda *a, **k: calls.append(len(a) - 1) or real(*a, **k))
    with torch.no_grad():
        # a copy each: ``output`` de-rotates its input in place
        fast = (*attn.project(x, pos, ropes, fmt), attn.output(out.clone(), pos, ropes))
        monkeypatch.setenv("DSAGENT_GEMV", "0")
        slow = (*attn.project(x, pos, ropes, fmt), attn.output(out.clone(), pos, ropes))
    assert sorted(calls) == [1, 1, 1, 1, 1]  # wq_a, wkv, wq_b, wo_a (grouped), wo_b: the reference's own
    for a, b in zip(fast, slow):
        close(a, b)


@needs_triton
def test_a_fused_steps_projection_normalises_the_query_inside_its_gemv(monkeypatch):
    """The fused step's projections (``decode_step._project``): the query's norm inside the ``wq_b`` GEMV, the K=V latent
    handed on as it is; the query agrees with the plain projection's to the norm's rounding;
    q_res only in a layer with an indexer, kept by that GEMV."""
    from model.rope import Ropes
    from model.quant import KVFormat

    args = ModelArgs.preset("tiny")
    g = torch.Generator().manual_seed(1)
    ropes, pos = Ropes(args).to(DEVICE), torch.tensor([7], device=DEVICE)
    for layer in (0, args.index_source_layer_ids[0]):
        attn = Attention(args, layer=layer)
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 if p.dim() > 1
                        else 1 + 0.1 * torch.randn(p.shape, generator=g))
        attn = attn.to(DEVICE, torch.bfloat16).eval()
        x = rand(2, 1, args.hidden_size, seed=12, dtype=torch.bfloat16)
        with torch.no_grad():
            _, q_res, q, kv = ds._project(attn, x, pos, ropes)
            want_res, want_q, _ = attn.project(x, pos, ropes, KVFormat.PACKED)
            latent = attn.wkv(x)
        assert (q_res is None) == (attn.indexer is None)
        close(q, want_q)
        close(kv, latent)
        if q_res is not None:  # kept by the query's GEMV, which normalised it: to the norm's rounding
            close(q_res, want_res)
            assert (q_res != want_res).float().mean() < 0.01


@needs_triton
def test_a_site_norm_left_to_the_projection_is_made_inside_its_gemv(monkeypatch):
    """``decode_step._project(norm=...)`` (an mHC site that left its RMSNorm to its consumer): x normalised
    inside the wq_a / wkv GEMV, which writes it for x's other readers (``keep``); x, q_res and
    the K=V latent as the norm kernel then the plain projection make them, to the norm's
    rounding; with the GEMV off the norm runs first, as its own launch."""
    from model.rope import Ropes
    from model.quant import KVFormat

    args = ModelArgs.preset("tiny")
    g = torch.Generator().manual_seed(3)
    ropes, pos = Ropes(args).to(DEVICE), torch.tensor([9], device=DEVICE)
    attn = Attention(args, layer=args.index_source_layer_ids[0])
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 if p.dim() > 1
                    else 1 + 0.1 * torch.randn(p.shape, generator=g))
    attn = attn.to(DEVICE, torch.bfloat16).eval()
    raw = rand(2, 1, args.hidden_size, seed=13, dtype=torch.bfloat16) * 7  # not of unit RMS
    weight = (1 + 0.1 * torch.randn(args.hidden_size, generator=g)).to(DEVICE, torch.bfloat16)
    calls = []
    real = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda *a, **k: calls.append(k.get("keep", False)) or real(*a, **k))
    with torch.no_grad():
        normed = kernels.rms_norm(raw, weight, 1e-6)
        want = ds._project(attn, normed, pos, ropes)
        calls.clear()
        got = ds._project(attn, raw, pos, ropes, norm=(weight, 1e-6))
        assert calls[0] is True  # the first GEMV normalised x and kept it
        monkeypatch.setenv("DSAGENT_GEMV", "0")
        first = ds._project(attn, raw, pos, ropes, norm=(weight, 1e-6))
    for g_, w_ in zip(got, want):
        close(g_, w_)
    assert torch.equal(first[0], normed) and (got[0] != normed).float().mean() < 0.01
    assert not torch.equal(got[0], raw)


class CountedReads(torch.nn.Module):
    """A test double of a QAT parametrization: the weight is computed on each read, counted."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        self.reads += 1
        return w


def test_linear_is_the_layer_off_the_fast_path(monkeypatch):
    """Off the GEMV (gradients on, or ``DSAGENT_GEMV=0``) a ``Linear`` is ``F.linear``, and a
    QAT weight is read once: the choice of kernel reads it only when all else holds."""
    from torch.nn.utils import parametrize

    layer, counted = Linear(8, 4), CountedReads()
    parametrize.register_parametrization(layer, "weight", counted)
    counted.reads = 0  # the registration's own read
    x = torch.randn(1, 8)
    want = torch.nn.functional.linear(x, layer.parametrizations.weight.original)
    assert torch.equal(layer(x), want) and counted.reads == 1  # gradients on
    monkeypatch.setenv("DSAGENT_GEMV", "0")
    with torch.no_grad():
        assert torch.equal(layer(x), want) and counted.reads == 2


@pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                    reason="needs Triton installed; on a GPU the kernel itself compiles in the tests above")
@pytest.mark.parametrize("block_o,block_d,two,bf16,pdl,extra", [
    (4, 2048, 1, 0, 0, {}), (16, 512, 1, 1, 1, {}), (1, 4096, 0, 1, 1, {}),
    (16, 512, 0, 1, 1, {"NORM": True, "ROPE_OUT": True}), (4, 2048, 0, 1, 1, {"ROPE_IN": True})])
def test_gemv_kernel_compiles_for_hopper(block_o, block_d, two, bf16, pdl, extra, tmp_path):
    """Triton's GPU compiler on the CPU, for sm_90 (``scripts/gpu_compile_check.py --compile``,
    a process without the interpreter): it types both branches of an ``if``, which the
    interpreter never does (a first version named tensors of two shapes alike in them, and
    failed on the GPU only); with ``pdl``, as a dependent launch (PTX the interpreter never
    runs), the weight's load placed before the wait; the query's norm and RoPE and the output's
    de-rotation in it (``extra``)."""
    constants = {"BLOCK_O": block_o, "BLOCK_D": block_d, "TWO": bool(two), "BF16": bool(bf16), "PDL": bool(pdl),
                 **extra}
    r = compile_for_hopper([gemv_launch(constants, {"launch_pdl": True} if pdl else {})], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def gemv_launch(constants: dict, options: dict, pointers: dict | None = None) -> dict:
    """``_gemv_kernel``'s launch for ``compile_for_hopper``: its signature (bf16 or fp32 by
    ``BF16``) in the kernel's order, the constexprs named in ``constants``, the rest at their
    defaults (the pointers that default to None left None, as a launch leaves them);
    ``pointers``: the types of pointers a launch passes otherwise (a packed weight's bytes and
    scales)."""
    import inspect

    from model.kernels import matvec

    f, o = ("*bf16", "*i16") if constants["BF16"] else ("*fp32", "*fp32")
    typed = {"x_ptr": f, "w_ptr": f, "out_ptr": o, "w2_ptr": f, "out2_ptr": o,
             **dict.fromkeys(("N", "O", "O2", "D", "DG", "OG", "P1"), "i32"), "nw_ptr": f, "eps": "fp32",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", **dict.fromkeys(("S", "HD", "OFF", "HALF"), "i32"),
             "xn_ptr": o, **(pointers or {})}
    params = inspect.signature(matvec._gemv_kernel.fn).parameters
    defaults = {name: p.default for name, p in params.items() if name not in typed and p.default is not p.empty}
    constants = {**defaults, **constants}
    signature = {name: typed.get(name, "constexpr") for name in params}
    return {"module": "model.kernels.matvec", "name": "_gemv_kernel", "signature": signature,
            "constants": constants, "options": options}


@needs_triton
def test_an_input_wider_than_a_tile_is_read_in_chunks_that_divide_it():
    """Past ``BLOCK_D_MAX`` a GEMV's input goes in the largest power-of-two chunks that divide
    it (from 256), else in BLOCK_D_MAX ones, the last cut short; an input read whole (a norm,
    a rotation) is one tile."""
    from model.kernels import matvec

    assert matvec.tile(129280, 5120, 1, 128)[1] == 1024
    assert matvec.tile(5120, 8192, 1, 128)[1] == matvec.BLOCK_D_MAX
    assert matvec.tile(64, 2 * matvec.BLOCK_D_MAX + 64, 1, 64)[1] == matvec.BLOCK_D_MAX
    assert matvec.tile(1792, 5120, 1, 256, whole=True)[1] == 8192
    assert matvec.tile(512, 2048, 2, 512)[1] == 2048
