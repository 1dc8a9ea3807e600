"""A config.json that is not what `ModelArgs` reads must fail as a `ConfigError` naming the
field, and `dsagent run --model DIR` must then say so with exit 1, never as an internal error.

Before `model/args.py` checked the JSON's shape and the fields' types, these surfaced as
AttributeError, TypeError, a bare ValueError, or were accepted (`hidden_size: 64.5`).
"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import dsagent.cli as cli
from model.args import ConfigError, ModelArgs

def _tiny_with(**text_fields) -> dict:
    cfg = ModelArgs.preset("tiny").to_config()
    cfg["text_config"].update(text_fields)
    return cfg


def _with(**top) -> dict:
    return {**ModelArgs.preset("tiny").to_config(), **top}


CASES = [
    pytest.param(_tiny_with(compress_ratios="abc"), "compress_ratios", id="ratios-not-a-list"),
    pytest.param([1, 2], "config.json", id="top-level-list"),
    pytest.param("hello", "config.json", id="top-level-string"),
    pytest.param(None, "config.json", id="top-level-null"),
    pytest.param(_with(text_config=[1]), "text_config", id="text-config-list"),
    pytest.param(_with(vision_config=[1]), "vision_config", id="vision-config-list"),
    pytest.param(_tiny_with(hidden_size="big"), "hidden_size", id="hidden-size-string"),
    pytest.param(_tiny_with(hidden_size=64.5), "hidden_size", id="hidden-size-float"),
    pytest.param(_tiny_with(hidden_size=True), "hidden_size", id="hidden-size-bool"),
    pytest.param(_tiny_with(rope_theta="x"), "rope_theta", id="rope-theta-string"),
    pytest.param(_with(quantization_config={"weight_block_size": "ab"}), "weight_block_size",
                 id="block-size-string"),
    pytest.param(_with(quantization_config=[32]), "quantization_config", id="quant-config-list"),
    pytest.param(_tiny_with(kv_source_layer_ids=[2, "4", 6]), "kv_source_layer_ids", id="layer-ids-not-ints"),
    pytest.param(_tiny_with(compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1.5]), "compress_ratios",
                 id="ratios-with-a-float"),
    pytest.param(_tiny_with(hidden_size=None), "hidden_size", id="hidden-size-null"),
    pytest.param(_tiny_with(scoring_func=3), "scoring_func", id="scoring-func-int"),
    pytest.param(_tiny_with(norm_topk_prob="yes"), "norm_topk_prob", id="bool-field-string"),
    pytest.param(_tiny_with(rope_scaling=[1]), "rope_scaling", id="rope-scaling-list"),
    pytest.param(_with(vision_config={"hidden_size": "wide"}), "vision_config.hidden_size",
                 id="vision-field-string"),
]


def test_a_good_config_json_still_reads(tmp_path):
    """Ints where floats are declared (JSON writes 10000.0 as 10000) and nulls where a field may
    be null are not type errors."""
    cfg = _tiny_with(rope_theta=10000, pad_token_id=None, rms_norm_eps=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ModelArgs.from_file(tmp_path)
    assert args.rope_theta == 10000 and args.pad_token_id is None and args.hidden_size == 128
    assert ModelArgs.from_config(ModelArgs.preset("tiny").to_config()) == ModelArgs.preset("tiny")


@pytest.mark.parametrize("cfg, field", CASES)
def test_a_bad_config_json_is_a_config_error_naming_the_field(tmp_path, cfg, field):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        ModelArgs.from_file(tmp_path)


def test_a_config_json_that_is_not_utf8_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    with pytest.raises(ConfigError, match="config.json"):
        ModelArgs.from_file(tmp_path)


def test_run_with_a_config_field_of_the_wrong_type_exits_1_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps(_tiny_with(hidden_size="big")))
    r = CliRunner().invoke(cli.app, ["run", "hi", "--model", str(tmp_path / "ck")])
    assert r.exit_code == 1 and "hidden_size" in r.stderr and "internal error" not in r.stderr
    assert not (tmp_path / "home" / "sessions.db").exists()
