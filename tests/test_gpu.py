"""The reference path on CUDA matches the CPU reference (skips cleanly without a GPU).

Run on the device machine with `python3 -m pytest -q tests/test_gpu.py` (it needs only the
`model` package). CI has no GPU, so everything here skips there; the CPU reference itself
is covered by tests/test_golden.py and tests/test_engine.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.engine import Engine
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build
from model.model import stable_topk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "v41-tiny-a"
SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.skipif(not GOLDEN.is_dir(), reason="shared/golden/v41-tiny-a is not beside the checkout")
def test_golden_logits_on_cuda():
    from safetensors.torch import load_file

    from model import load

    model = load(GOLDEN, device="cuda")
    cases = load_file(str(GOLDEN / "cases.safetensors"))
    for case in ("s37", "s150", "b2s64"):
        with torch.no_grad():
            logits = model(cases[f"{case}.input_ids"].cuda()).cpu()
        d = (logits - cases[f"{case}.logits"]).abs().amax(-1).flatten()
        assert d.median() <= 1e-3 and (d > 1e-2).float().mean() <= 0.10, case


def test_tiny_ced_prefill_and_decode_on_cuda_match_cpu():
    args = ModelArgs.preset("tiny").replace(**SMALL)
    runs = {}
    for device in ("cpu", "cuda"):
        model = build(args, seed=1).to(device).eval()  # built on the CPU: the random init is per device
        bind_tokenizer(model, BUNDLED_TOKENIZER)
        engine = Engine(model, mode="ced", chunk=40)
        state = engine.new_state()
        ids = torch.randint(3, 4000, (1, 120), generator=torch.Generator().manual_seed(0))
        engine.prefill(state, ids)
        runs[device] = state.cache.global_state()[0]
        assert all(t.device.type == "cpu" and t.dtype == torch.uint8 for t in runs[device].values())
    for name, t in runs["cpu"].items():
        assert (t == runs["cuda"][name]).float().mean() > 0.95, name  # rounding flips from float noise only


def test_stable_topk_ties_agree_between_devices():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")]])
    cpu = stable_topk(x, 3)[1]
    assert cpu.tolist() == [[1, 2, 4]]
    assert torch.equal(stable_topk(x.cuda(), 3)[1].cpu(), cpu)


def test_bf16_small_forward_runs_on_cuda():
    args = ModelArgs.preset("tiny").replace(**SMALL)
    model = build(args, device="cuda", dtype=torch.bfloat16, seed=2).eval()
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    engine = Engine(model)
    state = engine.new_state(batch=2)
    logits = engine.prefill(state, torch.randint(3, 4000, (2, 50)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert engine.decode(state, logits.argmax(-1)).shape == (2, args.vocab_size)


def _training_step(device: str, off: tuple[str, ...] = ()) -> tuple[float, dict[str, float]]:
    """Loss and gradient norms of one QAT training step of the embedded default on 3 rows
    of random ids, with the ``off`` switches (DSAGENT_*) set to 0."""
    import os
    import random

    from model.loading import load
    from model.training import Example, add_weight_qat, batch_for, batch_loss

    rng = random.Random(0)
    rows = [Example([rng.randrange(10, 4000) for _ in range(300)], [False] * 250 + [True] * 50) for _ in range(3)]
    switches = ("DSAGENT_KERNELS", "DSAGENT_DENSE_MOE", "DSAGENT_COMPILE")
    before = {k: os.environ.get(k) for k in switches}
    os.environ.update({k: "0" if k in off else "1" for k in switches})
    try:
        model = load(DEFAULT_MODEL, device=device)
        add_weight_qat(model)
        model.train()
        batch = batch_for(model.args, rows, ["exact"] * 3, random.Random(1))
        losses = batch_loss(model, batch, dense=True, share_prefix=False)
        losses.total.backward()
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return losses.lm.item(), {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}


def _assert_steps_agree(a, b, loss_rtol: float, grad_rtol: float) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(loss_a - loss_b) <= loss_rtol * abs(loss_a), (loss_a, loss_b)
    shared = [n for n in grads_a if n in grads_b and grads_a[n] > 1e-6]
    assert len(shared) > 100  # (an expert no token chose has a zero gradient densely, none in the loop)
    close = [abs(grads_a[n] - grads_b[n]) <= grad_rtol * grads_a[n] + 1e-6 for n in shared]
    worst = sorted(shared, key=lambda n: -abs(grads_a[n] - grads_b[n]) / grads_a[n])[:5]
    assert sum(close) >= 0.95 * len(shared), worst


@pytest.mark.xfail(strict=True, reason=(
    "open: the CUDA backward differs from the CPU's by a device-dependent path not yet found — "
    "H200, session 8 (.runs/diag_grads.py): global gradient relative error CPU vs CUDA 7.7% in "
    "float64 as in float32 (CPU fp32 vs fp64: 0.5%; CUDA fast vs CUDA reference: 0.15%), loss "
    "equal to 3e-5, the FP8/FP4 quantisers bit-equal across devices; worst: the 3-element mHC "
    "scales and some routed experts' weights; per-tensor norms within 2% for 91% (429 of 473)"))
def test_a_training_step_on_cuda_matches_the_cpu():
    """The CUDA training path — QAT values from the kernels, the dense MoE, the compiled mHC
    twin — gives the CPU reference's loss and gradients. On the trained default, not random
    weights: a random model's near-tied selections (gate top-k, indexer, candidate pool) turn
    float noise into other choices — on the CPU its loss moved by 2% between chunks of 1,024
    and 32 tokens, and from CPU to CUDA by 0.4% with every fast path off (H200, session 7) —
    where the default's moved by 2.4e-4 (chunks)."""
    _assert_steps_agree(_training_step("cpu"), _training_step("cuda"), 1e-3, 2e-2)


def test_the_cuda_training_fast_paths_match_the_cuda_reference():
    """On one device, the fast paths (kernels, dense MoE, compiled mHC) against the reference
    paths (all three switched off): only float order differs."""
    fast = _training_step("cuda")
    _assert_steps_agree(_training_step("cuda", ("DSAGENT_KERNELS", "DSAGENT_DENSE_MOE", "DSAGENT_COMPILE")), fast,
                        5e-4, 1e-2)