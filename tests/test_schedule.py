"""Shortened schedules (``ModelArgs.preset(name, layers=N, engram_rows=R)``): fewer layers that
still hold every kind of layer, and smaller Engram tables, for benchmarks at full width."""
from __future__ import annotations

import pytest
import torch

from model.args import ConfigError, ModelArgs


def _kinds(a: ModelArgs) -> set[str]:
    kinds = {a.role(i) for i in range(a.num_hidden_layers)} | {f"ratio-{r}" for r in set(a.ratios) if r}
    kinds |= {"engram"} if a.engram_layer_ids else set()
    kinds |= {"candidate source"} if a.candidate_source_layer_id >= 0 else set()
    kinds |= {"candidate reader"} if any(a.uses_candidates(i) for i in range(a.num_hidden_layers)) else set()
    return kinds | ({"ced"} if a.supports_ced else set())


@pytest.mark.parametrize("layers", [8, 9, 11, 16, 23, 39])
def test_a_shortened_full_model_keeps_every_kind_of_layer(layers):
    full, short = ModelArgs.preset("v41-flash"), ModelArgs.preset("v41-flash", layers=layers)
    assert short.num_hidden_layers == layers and _kinds(short) == _kinds(full)
    assert (short.hidden_size, short.n_routed_experts, short.index_topk) == (full.hidden_size, 384, 512)
    assert short.dspark_target_layer_ids == tuple(range(layers - 3, layers))


def test_too_few_layers_to_hold_every_kind_is_refused():
    with pytest.raises(ConfigError, match="layers: 7 cannot hold every kind"):
        ModelArgs.preset("v41-flash", layers=7)
    assert ModelArgs.preset("tiny", layers=40) == ModelArgs.preset("tiny")


def test_engram_rows_shrink_the_tables():
    a = ModelArgs.preset("v41-flash", layers=8, engram_rows=1_000_000)
    assert all(1_000_000 <= rows < 1_020_000 for rows in a.engram_num_embeddings)
    assert ModelArgs.preset("v41-flash").engram_num_embeddings[0] > 300 * a.engram_num_embeddings[0]


def test_a_shortened_model_prefills_and_decodes(tmp_path):
    from model.engine import Engine
    from model.loading import load

    args = ModelArgs.preset("tiny", layers=8, engram_rows=2000)
    model = load("tiny", args=args)
    assert len(model.layers) == 8 and model.layers[1].engram.embed.weight.shape[0] == args.engram_num_embeddings[0]
    engine = Engine(model, mode="ced", chunk=32)
    state = engine.new_state()
    engine.prefill(state, torch.randint(3, 1000, (1, 150), generator=torch.Generator().manual_seed(0)))
    logits = engine.decode(state, state.last_logits.argmax(-1))
    assert torch.isfinite(logits).all()


def test_a_benchmarks_model_reports_what_it_holds():
    """``bench_model`` (``gpu_bench.py --layers --engram-rows --weights``): on the meta device the
    full-width 8-layer cut's bytes, packed against plain, without allocating them."""
    from model.bench import bench_model

    _, packed = bench_model("v41-flash", device="meta", weights="packed", layers=8, engram_rows=1_000_000)
    _, plain = bench_model("v41-flash", device="meta", layers=8, engram_rows=1_000_000)
    assert packed["layers"] == 8 and packed["held_bytes"] < 0.3 * plain["held_bytes"]
    assert 65e9 < packed["held_bytes"] < 80e9  # fits one 141 GB GPU with room for the KV and activations
    model, tiny = bench_model("tiny", device="cpu", dtype=torch.float32, weights="packed", layers=8)
    assert tiny["load_s"] > 0 and len(model.layers) == 8 and model.hasher is not None


def test_a_preset_of_more_ids_than_the_bundled_tokenizer_gets_a_stand_in_token_map():
    """``v41-flash``'s 129K ids against the bundled tokenizer's 1,024: each id maps to its
    residue in the compressed vocabulary, so a prefill of any id runs (here a tiny preset
    widened to 3,000 ids, through ``model.loading.load`` as the CLI's ``--preset`` loads)."""
    from model.engine import Engine
    from model.loading import load, stand_in_token_map

    args = ModelArgs.preset("tiny").replace(vocab_size=3000)
    model = load("tiny", args=args)
    expected = stand_in_token_map(args)
    assert len(expected) == 3000 and expected[2999] == 2999 % args.engram_compressed_vocab_size
    assert model.hasher.token_map.tolist() == expected
    engine = Engine(model, mode="exact", chunk=64)
    state = engine.new_state()
    engine.prefill(state, torch.tensor([[5, 1500, 2999, 1024, 7]]))
    assert torch.isfinite(state.last_logits).all()
    assert load("tiny").hasher.token_map.shape[0] == 1024  # the bundled tokenizer's own map
