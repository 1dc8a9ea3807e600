"""scripts/widen_default.py: the default made twice as wide computes what it did — the same
logits to float rounding in memory, to the bf16 rounding of Engram's gate weight once written
— and a third of the 40 MB a shipped checkpoint may hold (issue 53)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from model.engine import Engine
from model.loading import load
from model.quant import KVFormat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"


def _logits(model, ids):
    engine = Engine(model, mode="exact")
    return engine.prefill(engine.new_state(kv=KVFormat.FLOAT), ids)


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    import widen_default

    out = tmp_path_factory.mktemp("wide") / "model"
    widen_default.main(["--init", str(DEFAULT), "--out", str(out)])
    return load(DEFAULT, device="cpu"), load(out, device="cpu"), out


def test_the_wider_checkpoint_computes_what_the_default_did(widened):
    narrow, wide, out = widened
    assert wide.args.hidden_size == 2 * narrow.args.hidden_size
    assert wide.args.replace(hidden_size=narrow.args.hidden_size) == narrow.args  # nothing else changed
    assert json.loads((out / "TRAINING.json").read_text())["hidden_size"] == [128, 256]
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size < 40e6 and size > 1.4 * sum(f.stat().st_size for f in DEFAULT.glob("*.safetensors"))
    g = torch.Generator().manual_seed(3)
    for n in (40, 300):
        ids = torch.randint(10, 1000, (1, n), generator=g)
        a, b = _logits(narrow, ids), _logits(wide, ids)
        assert (a - b).abs().max() < 1e-2 * a.abs().max()  # measured 1.2e-4 to 4e-4 of the largest
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_in_memory_the_widening_is_exact_to_float_rounding(widened):
    import widen_default

    narrow, wide, _ = widened
    _, state = widen_default.widen(narrow, 2)
    with torch.no_grad():
        for name, t in wide.state_dict().items():
            t.copy_(state[name].to(t.dtype))
    ids = torch.randint(10, 1000, (1, 200), generator=torch.Generator().manual_seed(4))
    a, b = _logits(narrow, ids), _logits(wide, ids)
    assert (a - b).abs().max() < 1e-4  # measured 5e-6 to 7e-6
    _, noisy = widen_default.widen(narrow, 2, noise=0.05, seed=1)
    assert any(not torch.equal(noisy[k], state[k]) for k in state)  # the copies parted
    assert all(torch.equal(noisy[k], state[k]) for k, t in narrow.state_dict().items() if t.shape == state[k].shape)


def test_a_dimension_that_is_not_the_residuals_is_left_alone():
    import widen_default

    w = torch.arange(12.0).reshape(2, 6)  # a reader of two stacked blocks of 3 channels
    wide = widen_default.widened("x.weight", w, torch.Size([2, 12]), 3, 2)
    assert torch.equal(wide, torch.cat([w[:, :3], w[:, :3], w[:, 3:], w[:, 3:]], dim=1) / 2)
    rows = widen_default.widened("x.weight", w.T, torch.Size([12, 2]), 3, 2)  # a writer: copies, not halves
    assert torch.equal(rows, torch.cat([w.T[:3], w.T[:3], w.T[3:], w.T[3:]]))
    with pytest.raises(ValueError):
        widen_default.widened("x.weight", w, torch.Size([2, 10]), 3, 2)
