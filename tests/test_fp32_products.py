"""The model's fp32 products (router, compressor, mHC mixes) through bf16 GEMMs on CUDA
(``model.kernels.products``), and no fp32 matmul left on a CUDA prefill (issue 51).

On the CPU: the three bf16 parts of an fp32 weight add up to it exactly, and the bf16-GEMM
form (its fp32 stand-in off CUDA) gives the reference's products to fp32 rounding. On CUDA
(skipped without): the same on ``torch.mm``'s fp32-output GEMM, and a bf16 prefill of a
small model, exact and CED, runs no matrix product on fp32 operands — counted op by op as
they are dispatched, a counter that does find the CPU reference's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.args import ModelArgs
from model.engine import Engine
from model.kernels import products
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_grouped_mm", "_scaled_mm"}
SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


class Fp32Matmuls(TorchDispatchMode):
    """Records every dispatched matrix product that has an fp32 operand."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            self.seen.append(f"{name}{tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))}")
        return func(*args, **(kwargs or {}))


def _weight(o: int, i: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(o, i, generator=g) * torch.logspace(-6, 1, i)  # magnitudes over seven decades


def test_three_bf16_parts_add_up_to_the_fp32_weight():
    w = _weight(24, 4096, 0)
    parts = products.bf16_parts(w).float().view(3, *w.shape)
    assert torch.equal(parts[0] + parts[1] + parts[2], w)
    assert (parts[1].abs() <= parts[0].abs()).all() and (parts[2].abs() <= parts[1].abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bf16_gemm_form_gives_the_fp32_products(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 1024, generator=g).bfloat16()
    w = _weight(40, 1024, 2).to(dtype)
    want = F.linear(x.double(), w.double())
    got = products._wide(x, w)
    plain = F.linear(x.float(), w.float())
    assert got.dtype == torch.float32 and got.shape == (2, 9, 40)
    scale = want.abs().amax()
    assert (got.double() - want).abs().max() <= 4 * (plain.double() - want).abs().max() + 1e-6 * scale


def test_an_fp32_weights_parts_are_made_once_and_again_when_it_changes():
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(8, 64)
    first = products._wide(x, w)
    parts = products._stacked(w)
    assert products._stacked(w) is parts and torch.equal(products._wide(x, w), first)
    with torch.no_grad():
        w.mul_(2)  # in place: a new version
    assert products._stacked(w) is not parts
    assert torch.allclose(products._wide(x, w), 2 * first, rtol=1e-6, atol=1e-6)
    key = id(w)
    del w
    assert key not in products._PARTS  # dropped with the weight


def test_the_mixes_norm_as_a_factor_after_the_product():
    g = torch.Generator().manual_seed(3)
    streams = (torch.randn(5, 7, 4 * 256, generator=g) * 3).bfloat16()
    fn = _weight(24, 4 * 256, 4)
    h = streams.double()
    want = F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), fn.double())
    got = products.normed_linear(streams, fn, 1e-6)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().amax().item())


def test_the_fp32_path_runs_off_cuda():
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(4, 8)
    assert not products.runs(x, w)  # the CPU: the reference's own fp32 products
    assert torch.equal(products.fp32_linear(x, w), F.linear(x.float(), w.float()))


def _prefill(device: str, dtype: torch.dtype, mode: str) -> list[str]:
    args = ModelArgs.preset("tiny").replace(**SMALL)
    model = build(args, seed=1).to(device, dtype).eval()
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    engine = Engine(model, mode=mode, chunk=64)
    state = engine.new_state()
    ids = torch.randint(3, 1000, (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Fp32Matmuls() as seen:
        engine.prefill(state, ids)
    return seen.seen


def test_the_counter_finds_the_cpu_references_fp32_products():
    seen = _prefill("cpu", torch.float32, "exact")
    assert len(seen) > 10, seen


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp32_products_on_cuda(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 2048, generator=g).bfloat16().cuda()
    w = _weight(384, 2048, 6).to(dtype).cuda()
    assert products.runs(x, w)
    want = F.linear(x.double(), w.double())
    got = products.fp32_linear(x, w)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().amax()
    streams = torch.randn(300, 4 * 512, generator=g).bfloat16().cuda()
    fn = _weight(24, 4 * 512, 7).cuda()
    h = streams.double()
    want = F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), fn.double())
    assert torch.allclose(products.normed_linear(streams, fn, 1e-6).double(), want, rtol=1e-5,
                          atol=1e-6 * want.abs().amax().item())


@cuda
@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_a_bf16_prefill_on_cuda_runs_no_fp32_matmul(mode):
    assert _prefill("cuda", torch.bfloat16, mode) == []
