"""The decode step's top-k kernel (``model.kernels.select.topk_rows``) against its twin
``topk_rows_ref``, and the twin against the model's own choice (``top_records``,
``candidate_rows``). The kernel runs on CUDA or under ``TRITON_INTERPRET=1``; the twin on
every run."""
from __future__ import annotations

import pytest
import torch

from model import kernels
from model.csa2 import _block_scores, candidate_blocks, candidate_rows
from model.kernels import topk_rows_ref, triton_available
from model.kernels.reference import stable_topk, top_records

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def scores_case(R: int, n: int, *, seed: int = 0, levels: int | None = 7, visible: list[int] | None = None,
                signed_zeros: bool = False, pinned: bool = False) -> torch.Tensor:
    """Scores with many exact ties (``levels`` distinct values), -inf past each row's visible
    count, -0.0 beside +0.0, and a +inf (the pool's pinned block) where asked."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(R, n, generator=g)
    if levels:
        s = (s * levels / 3).round() / levels
    if signed_zeros:
        s = torch.where(torch.rand(R, n, generator=g) < 0.3, torch.zeros(R, n), s)
        s = torch.where(torch.rand(R, n, generator=g) < 0.5, s, -s)  # zeros of both signs
    if visible is not None:
        s = s.masked_fill(torch.arange(n) >= torch.tensor(visible)[:, None], float("-inf"))
    if pinned:
        s[:, n // 3] = float("inf")
    return s


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or an error naming the first entries that differ."""
    if got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero()[:6].tolist() if got.shape == want.shape else "shapes"
        raise AssertionError(f"shapes {tuple(got.shape)} / {tuple(want.shape)}; first differing [row, slot]: {bad}; "
                             f"got {[got[tuple(b)].item() for b in bad] if bad != 'shapes' else ''} "
                             f"want {[want[tuple(b)].item() for b in bad] if bad != 'shapes' else ''}")


def case_scores(case: dict) -> tuple[torch.Tensor, int]:
    """A CASES entry's scores (on the CPU) and its k (512 unless it names one)."""
    case = dict(case)
    k = case.pop("k", 512)
    return scores_case(**case), k


def model_choice(s: torch.Tensor, k: int, rows=None) -> list[list[int]]:
    """``top_records``' choice as sorted lists without the -1s."""
    return [sorted(i for i in r if i >= 0) for r in top_records(s, k, rows).tolist()]


CASES = [dict(R=1, n=5000, k=512), dict(R=3, n=4097, k=512, visible=[4097, 1000, 300]),
         dict(R=2, n=300, k=512, visible=[300, 17]), dict(R=1, n=16384, k=2048, levels=None, pinned=True),
         dict(R=2, n=9000, k=512, signed_zeros=True, levels=3), dict(R=1, n=2048, k=512, visible=[0]),
         dict(R=1, n=700, k=700, levels=2), dict(R=1, n=64, k=512, levels=None),
         dict(R=2, n=20000, k=1000, levels=1), dict(R=1, n=40000, k=512, levels=None, visible=[39000]),
         dict(R=1, n=6145, k=3000, levels=2, signed_zeros=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c['R']}-n{c['n']}-k{c['k']}")
def test_twin_is_the_models_choice(case) -> None:
    s, k = case_scores(case)
    twin = topk_rows_ref(s, k, width=max(k, 512))
    for got, want in zip(twin.tolist(), model_choice(s, k)):
        assert got[:len(want)] == want and all(i == -1 for i in got[len(want):])


def test_twin_maps_rows_in_order() -> None:
    s = scores_case(2, 3000, seed=3)
    rows = torch.arange(3000).mul(5).expand(2, -1).clone()
    rows[:, 2500:] = -1
    s[:, 2500:] = float("-inf")  # a pool's -1 rows score -inf
    got = topk_rows_ref(s, 512, rows)
    assert got.tolist() == [sorted(r) for r in top_records(s, 512, rows).tolist()]


@pytest.mark.parametrize("select", ["1", "0"])
def test_the_candidate_pool_is_the_sorted_choice(select, monkeypatch) -> None:
    """candidate_rows (the decode path, through topk_rows: the kernel where it runs, else
    the twin) keeps what the sorted choice keeps."""
    monkeypatch.setenv("DSAGENT_SELECT", select)
    s = scores_case(1, 8 * 600 + 5, seed=5, levels=4, visible=[4000])[:, None]
    lens = torch.tensor([4000])
    blocks = _block_scores(s, lens, 8)
    values, indices = stable_topk(blocks, 256)
    first = indices.masked_fill(values == float("-inf"), blocks.shape[-1]).sort(dim=-1).values * 8
    want = (first[..., None] + torch.arange(8)).flatten(-2)
    got = candidate_rows(s.to(DEVICE), lens.to(DEVICE), 256, 8).cpu()
    assert torch.equal(got, want.masked_fill(want >= s.shape[-1], -1))
    # the prefill's mask form keeps the same records
    mask = candidate_blocks(s.to(DEVICE), lens.to(DEVICE), 256, 8).cpu()
    kept = want[(want >= 0) & (want < s.shape[-1])]
    assert mask.sum().item() == kept.numel() and mask[0, 0, kept].all()


@pytest.mark.parametrize("select", ["1", "0"])
def test_a_prefills_selection_is_the_sorted_choice(select, monkeypatch) -> None:
    """kernels.top_records (the indexer's choice at prefill: through topk_rows outside autograd
    where its kernel runs, else the reference) picks the records the sorted choice picks, -1
    where a query sees fewer than k; with a gradient wanted, the reference's own order."""
    monkeypatch.setenv("DSAGENT_SELECT", select)
    s = torch.stack([scores_case(6, 3000, seed=9, levels=5, visible=[0, 7, 511, 512, 2000, 3000])] * 2)
    want = top_records(s, 512)
    with torch.no_grad():
        got = kernels.top_records(s.to(DEVICE), 512).cpu()
    assert got.shape == want.shape == (2, 6, 512)
    assert [sorted(r) for r in got.flatten(0, 1).tolist()] == [sorted(r) for r in want.flatten(0, 1).tolist()]
    assert (got[:, 1, 7:] == -1).all() and (got[:, 0] == -1).all()
    with torch.enable_grad():
        assert torch.equal(kernels.top_records(s, 512), want)


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c['R']}-n{c['n']}-k{c['k']}")
def test_kernel_matches_twin(case) -> None:
    from model.kernels import select

    s, k = case_scores(case)
    s = s.to(DEVICE)
    for width in (None, max(k, 512) + 3):
        assert_same(select.topk_rows(s, k, width=width), topk_rows_ref(s, k, width=width))


@needs_kernel
@pytest.mark.parametrize("slice_", [1024, 4096])
def test_kernel_slice_sizes(slice_, monkeypatch) -> None:
    """A fixed slice (SELECT_SLICE, a tuning knob; 0 picks by the row's length) picks the same."""
    from model.kernels import select

    monkeypatch.setattr(select, "SELECT_SLICE", slice_)
    for case in (CASES[0], CASES[3], CASES[8], CASES[9]):
        s, k = case_scores(case)
        s = s.to(DEVICE)
        assert_same(select.topk_rows(s, k, width=k + 1), topk_rows_ref(s, k, width=k + 1))


@needs_kernel
def test_kernel_maps_rows() -> None:
    from model.kernels import select

    s = scores_case(2, 3000, seed=4, levels=5)
    rows = (torch.arange(3000) * 3 + 1).expand(2, -1).clone()
    rows[:, 2900:] = -1
    s[:, 2900:] = float("-inf")
    s, rows = s.to(DEVICE), rows.to(DEVICE)
    assert_same(select.topk_rows(s, 512, rows), topk_rows_ref(s, 512, rows))
    assert_same(kernels.topk_rows(s, 512, rows), topk_rows_ref(s, 512, rows))


@needs_kernel
def test_kernel_is_the_same_every_call() -> None:
    """Rows of many lengths and tie counts, the programs of a row finishing in whatever order
    the GPU runs them: every call equal to the twin (under the interpreter, a few)."""
    from model.kernels import select

    g = torch.Generator().manual_seed(11)
    calls = 40 if DEVICE == "cuda" else 3
    for c in range(calls):
        R = int(torch.randint(1, 17, (1,), generator=g))
        n = int(torch.randint(1, 140_000 if DEVICE == "cuda" else 9000, (1,), generator=g))
        k = int(torch.randint(1, 2100, (1,), generator=g))
        levels = [None, 1, 3, 50][c % 4]
        visible = torch.randint(0, n + 1, (R,), generator=g).tolist()
        s = scores_case(R, n, seed=c, levels=levels, visible=visible).to(DEVICE)
        assert_same(select.topk_rows(s, k, width=k + 5), topk_rows_ref(s, k, width=k + 5))
