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


def test_a_training_step_on_cuda_matches_the_cpu():
    """The CUDA training path — QAT values from the kernels, the dense MoE, the compiled mHC
    twin — gives the CPU reference's loss and gradients (tiny preset, QAT, exact replay)."""
    import random

    from model.training import Example, add_weight_qat, batch_loss, make_batch

    args = ModelArgs.preset("tiny").replace(**SMALL)
    rng = random.Random(0)
    rows = [Example([rng.randrange(10, 4000) for _ in range(90)], [False] * 70 + [True] * 20) for _ in range(3)]
    got = {}
    for device in ("cpu", "cuda"):
        model = build(args, seed=2).to(device)
        bind_tokenizer(model, BUNDLED_TOKENIZER)
        add_weight_qat(model)
        model.train()
        batch = make_batch(rows, ["exact"] * 3, window=args.sliding_window, decoder_start=args.decoder_start,
                           layers=args.num_hidden_layers, pad_id=args.pad_token_id, rng=random.Random(1))
        losses = batch_loss(model, batch, dense=True, share_prefix=False)
        losses.total.backward()
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
        got[device] = (losses.lm.item(), grads)
    (cpu_loss, cpu_grads), (cuda_loss, cuda_grads) = got["cpu"], got["cuda"]
    assert abs(cpu_loss - cuda_loss) <= 1e-3 * abs(cpu_loss)
    shared = [n for n in cpu_grads if n in cuda_grads and cpu_grads[n] > 1e-6]
    assert len(shared) > 100
    close = [abs(cpu_grads[n] - cuda_grads[n]) <= 1e-2 * cpu_grads[n] + 1e-6 for n in shared]
    assert sum(close) >= 0.95 * len(shared)
