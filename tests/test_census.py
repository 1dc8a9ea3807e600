"""The census behind ``dsagent model info``: v41-flash against ARCHITECTURE.md §5, tiny sanity,
the counting shortcut against a full build, and the CLI's JSON.

Expected figures (§5.1, §5.3, §1.3): ≈552B backbone, ≈16B active per decoded token,
≈8B per prefilled token, ≈763B in total, exactly 890 B/token of global KV, and Engram
prime sums equal to ``engram_num_embeddings``. The vision tower is also checked against
an independent count from the shapes listed in §3.3.
"""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsagent.commands.model import app
from model.args import ModelArgs
from model.census import backbone_counts, census
from model.model import Transformer

JSON_KEYS = {"params_total", "params_backbone", "params_active_decode", "params_active_prefill",
             "kv_global_bytes_per_token", "layers"}


@pytest.fixture(scope="module")
def flash() -> dict:
    return census(ModelArgs.preset("v41-flash"))


@pytest.fixture(scope="module")
def tiny() -> dict:
    return census(ModelArgs.preset("tiny"))


def test_v41_flash_parameters(flash) -> None:
    assert flash["params_backbone"] == pytest.approx(552e9, rel=0.01)
    assert flash["params_active_decode"] == pytest.approx(16e9, rel=0.05)
    assert flash["params_active_prefill"] == pytest.approx(8e9, rel=0.10)
    assert flash["params_total"] == pytest.approx(763e9, rel=0.02)
    assert flash["params_engram"] == pytest.approx(196.9e9, rel=0.01)
    assert flash["params_dspark"] == pytest.approx(14.2e9, rel=0.02)
    assert flash["params_total"] == sum(flash[k] for k in ("params_backbone", "params_engram", "params_dspark",
                                                           "params_vision"))


def test_v41_flash_routed_experts_from_module_shapes(flash) -> None:
    """384 experts x 3 x 5120 x 2304 per layer, 40 layers (§5.3)."""
    assert flash["params_by_part"]["routed_experts"] == 40 * 384 * 3 * 5120 * 2304


def test_v41_flash_vision_matches_an_independent_count(flash) -> None:
    h, inter, D = 1024, 2816, 5120
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + h * 2 * inter + inter * h
    aligner = (9 * h * D + D) + (D * D + D)
    assert flash["params_vision"] == (588 * h + h) + 32 * block + h + aligner + 3 * D


def test_v41_flash_kv_bytes_exact(flash) -> None:
    assert flash["kv_global_bytes_per_token"] == 890
    assert isinstance(flash["kv_global_bytes_per_token"], int)


def test_v41_flash_engram_prime_sums(flash) -> None:
    assert [(t["layer"], t["primes_sum"]) for t in flash["engram_tables"]] == [(1, 384006168), (14, 384016682)]
    assert all(t["match"] and t["num_embeddings"] == t["primes_sum"] for t in flash["engram_tables"])


def test_v41_flash_layer_roles(flash) -> None:
    layers = flash["layers"]
    assert len(layers) == 40 and [r["index"] for r in layers] == list(range(40))
    roles = {r["index"]: r["role"] for r in layers}
    assert [i for i, r in roles.items() if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r == "reindex"] == [24, 28, 32, 36]
    assert [i for i, r in roles.items() if r == "swa"] == [0, 1]
    assert sum(r == "reuse" for r in roles.values()) == 30
    assert [r["index"] for r in layers if r["candidates"]] == [24, 28, 32, 36]
    assert [r["index"] for r in layers if r["candidate_source"]] == [20]
    assert [r["index"] for r in layers if r["engram"]] == [1, 14]
    assert {r["part"] for r in layers[:20]} == {"encoder"} and {r["part"] for r in layers[20:]} == {"decoder"}
    assert layers[9]["kv_source"] == 8 and layers[33]["kv_source"] == 20 and layers[33]["index_source"] == 32
    assert layers[0]["kv_source"] is None and layers[0]["ratio"] == 0


def test_counting_shortcut_equals_a_full_build() -> None:
    """backbone_counts builds one MoE and reuses it per layer; a full build must agree."""
    args = ModelArgs.preset("tiny")
    with torch.device("meta"):
        full = {n: p.numel() for n, p in Transformer(args).named_parameters()}
    assert backbone_counts(args) == full


def test_tiny_census_is_sane(tiny) -> None:
    args = ModelArgs.preset("tiny")
    with torch.device("meta"):
        total_built = sum(p.numel() for p in Transformer(args).parameters())
    assert tiny["params_backbone"] + tiny["params_engram"] + tiny["params_vision"] == total_built
    assert tiny["params_dspark"] == 0  # no draft stages in tiny
    assert tiny["params_active_prefill"] < tiny["params_active_decode"] < tiny["params_backbone"]
    assert tiny["kv_global_bytes_per_token"] == 2 * (288 + 68) / 2 + (288 + 68)  # sources 2, 4 (ratio 2) and 6
    assert [r["role"] for r in tiny["layers"]] == ["swa", "swa", "full", "reuse", "full", "reuse", "full", "reuse",
                                                  "reindex", "reuse"]
    assert all(t["match"] for t in tiny["engram_tables"])
    assert sum(r["params"] for r in tiny["layers"]) + tiny["params_by_part"]["embed"] \
        + tiny["params_by_part"]["head"] + tiny["params_vision"] == total_built


def test_cli_info_json() -> None:
    result = CliRunner().invoke(app, ["info", "--preset", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert JSON_KEYS <= set(data)
    assert data["kv_global_bytes_per_token"] == 712 and len(data["layers"]) == 10


def test_cli_info_of_a_preset_cut_as_the_benchmarks_cut_it() -> None:
    """``--layers`` / ``--engram-rows``: the census of ``ModelArgs.preset(name, layers, rows)``,
    the model the benchmarks build (what fits a GPU), named so in the table."""
    result = CliRunner().invoke(app, ["info", "--preset", "small", "--layers", "8", "--engram-rows", "1000",
                                      "--gpus", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    cut = ModelArgs.preset("small", layers=8, engram_rows=1000)
    assert len(data["layers"]) == cut.num_hidden_layers == 8 and "cut to 8 layers" in data["model"]
    assert data["params_total"] == census(cut)["params_total"] < census(ModelArgs.preset("small"))["params_total"]
    whole = CliRunner().invoke(app, ["info", "--preset", "small", "--gpus", "1", "--json"])
    assert json.loads(whole.output)["per_gpu"][0]["packed"]["gpu_total"] > data["per_gpu"][0]["packed"]["gpu_total"]


def test_cli_info_table_and_errors() -> None:
    result = CliRunner().invoke(app, ["info", "--preset", "tiny"], env={"COLUMNS": "160"})
    assert result.exit_code == 0 and "global KV bytes per token" in result.output and "reindex" in result.output
    bad = CliRunner().invoke(app, ["info", "--preset", "nope"])
    assert bad.exit_code == 1 and "unknown preset" in bad.output


def test_cli_info_on_a_directory_without_shards(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(ModelArgs.preset("tiny").to_config()))
    result = CliRunner().invoke(app, ["info", "--model", str(tmp_path), "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["params_backbone"] == census(ModelArgs.preset("tiny"))["params_backbone"]
    assert "checkpoint" not in data  # no shard index: a warning on stderr, no dtype census


def test_cli_info_adds_the_checkpoint_census(tmp_path, monkeypatch) -> None:
    from model import checkpoint

    (tmp_path / "config.json").write_text(json.dumps(ModelArgs.preset("tiny").to_config()))
    fake = {"tensors": 3, "bytes": 12, "by_dtype": {"F32": {"tensors": 3, "bytes": 12, "parameters": 3}}}
    monkeypatch.setattr(checkpoint, "census", lambda path: fake)  # test double for the reader
    result = CliRunner().invoke(app, ["info", "--model", str(tmp_path), "--json"])
    assert json.loads(result.stdout)["checkpoint"] == fake
    table = CliRunner().invoke(app, ["info", "--model", str(tmp_path)])
    assert table.exit_code == 0 and "Checkpoint tensors by dtype" in table.stdout


def test_decode_read_bytes_counted_by_hand():
    """tiny at 1000 tokens: windows 10 x 128 x 528 B; 8 sparse layers select 16 records of
    288 B; Full layers 2 and 4 (ratio 2) score 500 index keys of 68 B, Full 6 (ratio 1) 1000,
    Reindex 8 only layer 6's candidate pool: 8 blocks of 4."""
    from model.args import PRESETS
    from model.census import decode_read_bytes

    args = PRESETS["tiny"]()
    got = decode_read_bytes(args, 1000, weight_bytes=4)
    assert got["window"] == 10 * 128 * 528
    assert got["records"] == 8 * 16 * 288
    assert got["index_keys"] == (500 + 500 + 1000 + 32) * 68
    assert got["weights"] == 4 * census(args)["params_active_decode"]
    assert got["total"] == got["weights"] + got["window"] + got["records"] + got["index_keys"]
    assert decode_read_bytes(args, 10)["window"] == 10 * 10 * 528  # a short context fills part of each window


@pytest.mark.parametrize("packed", [True, False])
def test_the_bytes_a_rank_holds_are_those_of_its_loaded_part(packed) -> None:
    """``rank_bytes``, counted from shapes, against the parameters of the tiny preset's part
    that each rank of one and of two actually loads (bf16; packed: FP8 / FP4 as stored), with
    the Engram tables apart: a rank's share of their rows, and whole."""
    from model.census import rank_bytes
    from model.linear import World
    from model.loading import load

    from model.args import ModelArgs

    drafts = ModelArgs.preset("tiny").replace(num_nextn_predict_layers=2)  # split over the ranks as the layers are
    for ranks, rank in ((1, 0), (2, 0), (2, 1)):
        m = load("tiny", dtype=torch.bfloat16, weights="packed" if packed else "plain", world=World(rank, ranks),
                 args=drafts)
        assert len(m.mtp) == 2 and len(m.mtp[0].ffn.experts) == drafts.dspark_n_routed_experts // ranks
        held = {"tables": 0, "rest": 0}
        for name, p in m.named_parameters():
            held["tables" if ".engram.embed." in name else "rest"] += p.numel() * p.element_size()
        counted = rank_bytes(m.args, ranks, packed=packed)
        assert (counted["gpu_total"], counted["engram_share"]) == (held["rest"], held["tables"]), (ranks, rank)
        assert counted["engram_tables"] == rank_bytes(m.args, 1, packed=packed)["engram_share"]


def test_cli_info_gpus() -> None:
    """``model info --gpus N``: the weights a GPU holds per N; an N the model cannot split by is
    a usage error naming what does not split."""
    out = json.loads(CliRunner().invoke(app, ["info", "--preset", "v41-flash", "--gpus", "1", "--gpus", "4",
                                              "--json"]).stdout)
    one, four = (r["packed"] for r in out["per_gpu"])
    assert four["routed_experts"] * 4 == one["routed_experts"] and four["engram_tables"] == one["engram_tables"]
    assert 70e9 < four["gpu_total"] < 80e9  # what makes four H200s (141 GB each) the machine to run it on
    assert four["engram_share"] == -(-384016682 // 4) * 264 + -(-384006168 // 4) * 264  # e4m3 rows + 8 scales
    r = CliRunner().invoke(app, ["info", "--preset", "v41-flash", "--gpus", "3"])
    assert r.exit_code == 2 and "split" in r.output


# ----------------------------------------------------------------------------- prefill FLOPs

def _counted_prefill(model, mode: str, lengths: tuple[int, ...], monkeypatch) -> list[dict]:
    """Each prefill of ``lengths`` (one after another on one state) run on the reference path,
    its FLOPs counted from what ran, independently of the census: torch's FLOP counter for the
    2-D products (every projection but the grouped ``wo_a``, which runs as a batched product:
    2 x its weight per token of a layer's run), and the attention and indexer entries the
    queries actually see (unmasked window keys and selected records, finite index scores after
    the candidate pool), counted by wrapping the functions that consume them."""
    from torch.utils.flop_counter import FlopCounterMode

    from model import block, kernels
    from model.engine import Engine

    from model.moe import GroupedLinear

    seen = {"keys": 0, "scores": 0, "wo_a_tokens": 0, "grouped": 0}
    attend, top, output = block.Attention.attend, kernels.top_records, block.Attention.output
    grouped = GroupedLinear.forward

    def count_attend(self, q, keys, key_mask, records):
        seen["keys"] += int(key_mask.expand(q.shape[0], -1, -1).sum()) * q.shape[2]
        if records is not None:
            seen["keys"] += int(records[1].sum()) * q.shape[2]
        return attend(self, q, keys, key_mask, records)

    def count_top(s, k, *rest):
        if k == model.args.index_topk:  # the records' choice, not the candidate pool's blocks
            seen["scores"] += int(torch.isfinite(s).sum())
        return top(s, k, *rest)

    def count_output(self, out, pos, ropes):
        seen["wo_a_tokens"] += out.shape[0] * out.shape[1]
        return output(self, out, pos, ropes)

    def count_grouped(self, x, *rest, **kw):
        seen["grouped"] += 2 * x.shape[0] * x.shape[1] * self.weight.shape[1]  # every (token, expert) row
        return grouped(self, x, *rest, **kw)

    monkeypatch.setattr(block.Attention, "attend", count_attend)
    monkeypatch.setattr(GroupedLinear, "forward", count_grouped)
    monkeypatch.setattr(kernels, "top_records", count_top)
    monkeypatch.setattr(block.Attention, "output", count_output)
    engine = Engine(model, mode=mode, chunk=96)
    state, out = engine.new_state(), []
    wo_a = model.layers[0].attn.wo_a.weight.numel()
    for i, n in enumerate(lengths):
        seen.update(keys=0, scores=0, wo_a_tokens=0, grouped=0)
        with FlopCounterMode(display=False) as counter:
            engine.prefill(state, torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(i)))
        mm = counter.get_flop_counts()["Global"].get(torch.ops.aten.mm, 0)
        # the head runs on each chunk's last token (the census counts the prompt's last alone)
        head = 2 * model.head.weight.numel() * (-(-n // engine.chunk) - 1 if mode == "exact" else 0)
        out.append({"mm": mm + 2 * wo_a * seen["wo_a_tokens"] + seen["grouped"] - head, "keys": seen["keys"],
                    "scores": seen["scores"]})
    return out


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_prefill_flops_equal_what_a_prefill_runs(mode, monkeypatch) -> None:
    """The census's prefill FLOPs (counted from the config) against those of a real prefill on
    ``tiny`` (two prefills on one state, in chunks, so positions start past 0 and the candidate
    pool clips): every product, the attention's keys and the indexer's scores, part by part."""
    from model.census import prefill_flops
    from model.loading import build, stand_in_token_map

    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    args = ModelArgs.preset("tiny").replace(sliding_window=32, index_topk=8, candidate_topk_blocks=3,
                                           candidate_block_size=2)
    model = build(args, seed=3).eval()
    model.bind_token_map(stand_in_token_map(args))
    lengths = (150, 70)
    counted = _counted_prefill(model, mode, lengths, monkeypatch)
    start = 0
    for n, got in zip(lengths, counted):
        want = prefill_flops(args, n, mode, start=start)
        assert want["mode"] == mode and want["total"] == sum(want["by_part"].values())
        parts = want["by_part"]
        pools = sum(3 * args.ratios[s] * args.head_dim * ((start + n) // args.ratios[s] - start // args.ratios[s])
                    for s in args.kv_source_layer_ids if args.ratios[s] > 1)
        assert parts["linear"] + parts["compressor"] - pools + parts["mhc"] + parts["router"] == got["mm"]
        assert parts["attention"] == 4 * args.head_dim * got["keys"]
        assert parts["indexer"] == 2 * args.index_n_heads * (args.index_head_dim + 1) * got["scores"]
        start += n


def test_prefill_flops_of_small_ced_at_32k() -> None:
    """``small``'s CED prefill: ~2.2 GFLOP of projections a token (the figure the prefill issue
    starts from), the exact mode about twice CED, and the attention a few tenths of a GFLOP."""
    from model.census import prefill_flops

    args = ModelArgs.preset("small")
    ced, exact = prefill_flops(args, 32768, "ced"), prefill_flops(args, 32768, "exact")
    assert ced["by_part"]["linear"] / 32768 == pytest.approx(2.17e9, rel=0.02)
    assert 1.8 < exact["total"] / ced["total"] < 2.2
    assert 0.2e9 < ced["by_part"]["attention"] / 32768 < 0.6e9
    with pytest.raises(ValueError, match="prefill mode"):
        prefill_flops(args, 8, "fast")
