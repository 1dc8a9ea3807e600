"""The model against the shared golden set ``v41-tiny-a`` (HF ``deepseek_v41`` reference).

Every case is loaded with ``model.load(<golden dir>)`` and run in float32. Checked, with
the README's rules: the Engram token map derived from the golden ``tokenizer.json``; the
Engram row ids (exact); the logits (per case, d_p = max_v |Δ| per position: median
d_p <= 1e-3 and at most 10% of positions above 1e-2); per layer, the relative error of
the hc streams and agreement of the top-k masks, the candidate mask and the router
choices; and chunked feeding through one Cache (s150: 76 tokens, 12 single tokens, rest).

The golden files the tests read are copied verbatim into ``tests/golden/v41-tiny-a``
(provenance in ``tests/golden/README.md``), so the tests run in a fresh clone. Hooks only
observe: they record what layers return and never change it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import model
from model.engram import compressed_token_map

GOLDEN = Path(__file__).resolve().parent / "golden" / "v41-tiny-a"
CASES = ("s37", "s64", "s150", "b2s64")


@pytest.fixture(scope="module")
def golden():
    from safetensors.torch import load_file

    return load_file(str(GOLDEN / "cases.safetensors"))


@pytest.fixture(scope="module")
def net():
    return model.load(GOLDEN)


def _tolerance(logits: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    d = (logits.float() - expected).abs().amax(-1).flatten()
    return d.median().item(), (d > 1e-2).float().mean().item()


def _assert_within(logits: torch.Tensor, expected: torch.Tensor) -> None:
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    median, frac = _tolerance(logits, expected)
    assert median <= 1e-3 and frac <= 0.10, f"median d_p {median:.2e}, {frac:.1%} of positions above 1e-2"


class Recorder:
    """Forward hooks that keep what each layer, indexer and gate returned."""

    def __init__(self, net):
        self.streams, self.topk, self.router, self.candidates, self.hash_ids = {}, {}, {}, None, None
        self.handles = []
        for i, layer in enumerate(net.layers):
            self.handles.append(layer.register_forward_hook(self._layer(i)))
            self.handles.append(layer.ffn.gate.register_forward_hook(self._gate(i)))
            if layer.attn.indexer is not None:
                self.handles.append(layer.attn.indexer.register_forward_hook(self._indexer(i)))
        self.handles.append(net.layers[0].register_forward_pre_hook(self._step))

    def _step(self, module, args):
        self.hash_ids = args[2].hash_ids

    def _layer(self, i):
        def hook(module, args, out):
            self.streams[i] = out[0].detach()
        return hook

    def _gate(self, i):
        def hook(module, args, out):
            self.router[i] = (out[0].detach(), out[1].detach())
        return hook

    def _indexer(self, i):
        def hook(module, args, out):
            self.topk[i] = out
            if "candidates" in args[2].shared and i == module.args.candidate_source_layer_id:
                self.candidates = args[2].shared["candidates"]
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def runs(net, golden):
    """One recorded forward per case."""
    out = {}
    for case in CASES:
        rec = Recorder(net)
        with torch.no_grad():
            logits = net(golden[f"{case}.input_ids"])
        rec.close()
        out[case] = (logits, rec)
    return out


def _mask(indices: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, k] record indices (-1 = none) -> [B, S, n] 0/1 mask."""
    mask = torch.zeros(*indices.shape[:2], n + 1, dtype=torch.uint8)
    mask.scatter_(-1, torch.where(indices >= 0, indices, n), 1)
    return mask[..., :n]


def _row_disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).flatten(0, -2).any(-1).float().mean().item()


def test_engram_token_map_from_tokenizer(golden) -> None:
    token_map, size = compressed_token_map(GOLDEN / "tokenizer.json")
    assert token_map == golden["engram_token_map"].tolist()
    assert size == 326


def test_config_and_weights_load(net) -> None:
    a = net.args
    assert (a.vocab_size, a.hidden_size, a.num_hidden_layers) == (384, 64, 10)
    assert [a.role(i) for i in range(10)] == ["swa", "swa", "full", "reindex", "full", "reuse", "full", "reuse",
                                             "reindex", "reuse"]
    assert net.hasher is not None and net.hasher.table_sizes == [660]


@pytest.mark.parametrize("case", CASES)
def test_engram_hash_ids_exact(case, golden, runs) -> None:
    assert torch.equal(runs[case][1].hash_ids, golden[f"{case}.engram_hash_ids"])


@pytest.mark.parametrize("case", CASES)
def test_logits_within_tolerance(case, golden, runs) -> None:
    _assert_within(runs[case][0], golden[f"{case}.logits"])


@pytest.mark.parametrize("case", CASES)
def test_layer_streams_close(case, golden, runs) -> None:
    """Relative error per position, max|Δ| / rms(golden); the README's noise level is 1e-4."""
    rec = runs[case][1]
    for i in range(10):
        want = golden[f"{case}.layers.{i}.streams"]
        got = rec.streams[i].float()
        rel = (got - want).abs().flatten(-2).amax(-1) / want.square().flatten(-2).mean(-1).sqrt()
        assert rel.median().item() <= 1e-4, f"layer {i}: median relative error {rel.median().item():.2e}"


@pytest.mark.parametrize("case", CASES)
def test_topk_and_candidate_masks_agree(case, golden, runs) -> None:
    rec = runs[case][1]
    for i, indices in rec.topk.items():
        want = golden[f"{case}.layers.{i}.topk_mask"]
        assert _row_disagreement(_mask(indices, want.shape[-1]), want) <= 0.02, f"layer {i} top-k"
    want = golden[f"{case}.layers.6.candidate_mask"]
    assert rec.candidates is not None and rec.candidates.shape == want.shape
    assert _row_disagreement(rec.candidates.to(torch.uint8), want) <= 0.02


@pytest.mark.parametrize("case", CASES)
def test_router_choices_agree(case, golden, runs) -> None:
    rec = runs[case][1]
    for i, (weights, indices) in rec.router.items():
        want_idx = golden[f"{case}.layers.{i}.router_indices"]
        same = (indices.sort(-1).values == want_idx.sort(-1).values).all(-1)
        assert same.float().mean().item() >= 0.98, f"layer {i}: {int((~same).sum())} tokens routed differently"
        order = indices.argsort(-1)
        want_w = golden[f"{case}.layers.{i}.router_weights"].gather(1, want_idx.argsort(-1))
        torch.testing.assert_close(weights.gather(1, order)[same], want_w[same], atol=1e-4, rtol=1e-4)


def test_chunked_feeding_matches_golden(net, golden) -> None:
    """s150 through one Cache: 76 tokens, then 12 single tokens, then the rest."""
    ids = golden["s150.input_ids"]
    cache = net.new_cache()
    with torch.no_grad():
        parts = [net(ids[:, :76], cache)]
        parts += [net(ids[:, t:t + 1], cache) for t in range(76, 88)]
        parts.append(net(ids[:, 88:], cache))
    assert cache.length == 150
    _assert_within(torch.cat(parts, dim=1), golden["s150.logits"])


def test_batch_rows_are_independent(net, golden) -> None:
    ids = golden["b2s64.input_ids"]
    with torch.no_grad():
        rows = torch.cat([net(ids[r:r + 1]) for r in range(2)])
    _assert_within(rows, golden["b2s64.logits"])
