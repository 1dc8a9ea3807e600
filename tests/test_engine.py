"""Engine properties on a small `tiny`-family model: exact vs incremental, CED prefill,
export / import / replay (in a fresh process), rollback, sampling and limits.

The random-weight model has discontinuous steps (FP4/FP8 rounding, top-k choices), so
logit comparisons use the golden README's rule: the median per-position max difference
and the share of positions above 1e-2, never a bare maximum.

These pin the engine on the reference path (``DSAGENT_KERNELS=0``, the CI path): where
Triton runs (CUDA, or its interpreter) the fused kernels differ from their twins by ~1e-7
(``tests/test_kernels.py``), and on a random model such noise moves FP8 roundings, so a
median-based threshold calibrated on one path is a coin toss on the other (measured under
the interpreter: 0.115 vs the 0.100 bound with the mHC kernel, 0.049 with its twin).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model import kernels
from model.args import ModelArgs
from model.cache import Cache, CacheFormatError
from model.engine import ContextLimitError, Engine, Sampling, sample_logits
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

WINDOW = 16
SMALL = dict(sliding_window=WINDOW, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("DSAGENT_KERNELS", "0")


def make_model(seed: int = 1):
    model = build(ModelArgs.preset("tiny").replace(**SMALL), seed=seed)
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def close_enough(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs().amax(-1).flatten()
    return d.median().item(), (d > 1e-2).float().mean().item()


GOLDEN = Path(__file__).resolve().parent / "golden" / "v41-tiny-a"


def prefill_then_decode(model, ids, split: int, chunk: int) -> torch.Tensor:
    engine = Engine(model, mode="exact", chunk=chunk)
    state = engine.new_state()
    got = [engine.prefill(state, ids[:, :split])]
    got += [engine.decode(state, ids[:, t]) for t in range(split, ids.shape[1] - 1)]
    return torch.stack(got, 1)


@pytest.mark.skipif(not GOLDEN.is_dir(), reason="tests/golden/v41-tiny-a is missing")
def test_decode_after_exact_prefill_equals_full_forward_golden():
    from safetensors.torch import load_file

    from model import load

    golden = load(GOLDEN)
    ids = load_file(str(GOLDEN / "cases.safetensors"))["s150.input_ids"]
    with torch.no_grad():
        full = golden(ids)
    median, frac = close_enough(prefill_then_decode(golden, ids, 101, 33), full[:, 100:149])
    assert median <= 1e-4 and frac == 0.0, (median, frac)


def test_decode_after_exact_prefill_equals_full_forward_tiny(model):
    """512-dim FP8/FP4 records make single rounding flips from float noise likely on a random
    model (one e4m3 ulp is 6-12%), so only the global KV and the bulk of the logits must agree."""
    ids = ids_of(140)
    with torch.no_grad():
        full_cache = model.new_cache()
        full = model(ids, full_cache)
    got = prefill_then_decode(model, ids, 100, 33)
    median, frac = close_enough(got, full[:, 99:139])
    assert median <= 0.1 * full.std().item(), (median, frac)
    engine = Engine(model, mode="exact", chunk=33)
    state = engine.new_state()
    engine.prefill(state, ids)
    for name, t in state.cache.global_state()[0].items():
        same = (t == full_cache.global_state()[0][name]).float().mean().item()
        assert same > 0.95, (name, same)


def test_ced_global_kv_is_bit_identical_to_exact(model):
    ids = ids_of(150, seed=2)
    states = {}
    for mode in ("exact", "ced"):
        engine = Engine(model, mode=mode, chunk=40)
        states[mode] = engine.new_state()
        engine.prefill(states[mode], ids)
    exact, _ = states["exact"].cache.global_state()
    ced, meta = states["ced"].cache.global_state()
    assert meta["sources"] == {"2": {"ratio": 2, "n": 75}, "4": {"ratio": 2, "n": 75}, "6": {"ratio": 1, "n": 150}}
    for name in exact:
        assert torch.equal(exact[name], ced[name]), name


def test_ced_equals_exact_when_the_prompt_fits_the_window(model):
    ids = ids_of(WINDOW - 3, seed=3)
    logits = [Engine(model, mode=m).prefill(Engine(model).new_state(), ids) for m in ("exact", "ced")]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_ced_runs_the_decoder_on_the_last_window_only(model):
    ids = ids_of(120, seed=4)
    engine = Engine(model, mode="ced", chunk=50)
    state = engine.new_state()
    engine.prefill(state, ids)
    dec, enc = model.args.decoder_start, 0
    decoder_positions = state.cache.windows[dec].pos
    assert int(decoder_positions[decoder_positions >= 0].min()) == 120 - WINDOW
    encoder_positions = state.cache.windows[enc].pos
    assert int(encoder_positions[encoder_positions >= 0].min()) < 120 - WINDOW


RESUME_CHILD = r"""
import json, sys, torch
from safetensors.torch import load_file
sys.path.insert(0, {tests!r})
from test_engine import make_model
from model.engine import Engine, Sampling
model = make_model()
engine = Engine(model, mode="exact", chunk=128)
meta = json.load(open({meta!r}))
state = engine.import_global(load_file({blob!r}), meta)
log = torch.tensor([json.load(open({ids!r}))])
engine.replay(state, log, tokens={replay})
print(json.dumps(list(engine.generate(state, Sampling(max_new_tokens=8)))))
"""


def test_resume_in_a_fresh_process_matches_an_uninterrupted_run(model, tmp_path: Path):
    ids = ids_of(90, seed=5)
    engine = Engine(model, mode="exact", chunk=128)  # one pass, so the replay repeats the same sums
    state = engine.new_state()
    engine.prefill(state, ids)
    tensors, meta = engine.export_global(state)
    save_file(tensors, str(tmp_path / "kv.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    baseline = list(engine.generate(state, Sampling(max_new_tokens=8)))
    code = RESUME_CHILD.format(tests=str(Path(__file__).parent), meta=str(tmp_path / "meta.json"),
                               blob=str(tmp_path / "kv.safetensors"), ids=str(tmp_path / "ids.json"), replay=90)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # a replay of the whole log rebuilds the local state exactly: the same greedy tokens
    assert json.loads(out.stdout.strip().splitlines()[-1]) == baseline


def test_default_replay_rebuilds_every_local_part(model):
    ids = ids_of(91, seed=6)  # odd: a ratio-2 source ends with a pending token
    engine = Engine(model, mode="ced")
    state = engine.new_state()
    engine.prefill(state, ids)
    resumed = engine.import_global(*engine.export_global(state))
    assert resumed.length == 91 and resumed.last_logits is None
    logits = engine.replay(resumed, ids)
    assert logits.shape == (1, model.args.vocab_size) and torch.isfinite(logits).all()
    for s, src in resumed.cache.sources.items():
        assert src.pending_kv.shape[1] == (1 if src.ratio == 2 else 0)
        assert src.n == state.cache.sources[s].n
    ring = resumed.cache.windows[0].pos
    assert sorted(ring[ring >= 0].tolist()) == list(range(91 - WINDOW, 91))


def test_import_refuses_state_of_another_config(model):
    engine = Engine(model)
    state = engine.new_state()
    engine.prefill(state, ids_of(20))
    tensors, meta = engine.export_global(state)
    other = ModelArgs.preset("tiny").replace(**{**SMALL, "sliding_window": 32})
    with pytest.raises(CacheFormatError, match="another model config"):
        Cache.from_state(other, tensors, meta)
    with pytest.raises(CacheFormatError, match="format"):
        Cache.from_state(model.args, tensors, {**meta, "format": 99})
    broken = {**tensors, "layers.2.kv": tensors["layers.2.kv"][:, :3]}
    with pytest.raises(CacheFormatError, match="layers.2"):
        Cache.from_state(model.args, broken, meta)


def test_rollback_then_refeed_gives_the_same_logits(model):
    ids = ids_of(61, seed=7)
    engine = Engine(model, mode="exact")
    state = engine.new_state()
    engine.prefill(state, ids[:, :50])
    first = [engine.decode(state, ids[:, t]).clone() for t in range(50, 61)]
    state.cache.truncate(53)  # odd length: the pending ratio-2 token is rebuilt from history
    again = [engine.decode(state, ids[:, t]) for t in range(53, 61)]
    for a, b in zip(first[3:], again):
        assert torch.allclose(a, b, atol=1e-5)


def test_context_limit_is_a_clear_error(model):
    engine = Engine(model, max_context=40)
    state = engine.new_state()
    engine.prefill(state, ids_of(30))
    with pytest.raises(ContextLimitError, match="context limit of 40"):
        engine.prefill(state, ids_of(11))
    assert state.length == 30


def test_generate_stops_on_stop_ids_and_limits(model):
    engine = Engine(model)
    state = engine.new_state()
    engine.prefill(state, ids_of(10))
    first = int(state.last_logits.argmax())
    out = list(engine.generate(state, Sampling(max_new_tokens=5, stop_ids=(first,))))
    assert out == [first] and state.length == 10  # the stop id is yielded, not consumed
    out = list(engine.generate(state, Sampling(max_new_tokens=4)))
    assert len(out) == 4 and state.length == 13


def test_sampling_modes():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    assert sample_logits(logits, Sampling()).item() == 2
    assert sample_logits(logits, Sampling(temperature=1.0, top_k=1)).item() == 2
    assert sample_logits(logits, Sampling(temperature=1.0, top_p=1e-6)).item() == 2
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    p = Sampling(temperature=1.0)
    assert [sample_logits(logits, p, g1).item() for _ in range(20)] == \
           [sample_logits(logits, p, g2).item() for _ in range(20)]
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_logits(logits, p, g).item() for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)
    top2 = torch.tensor([sample_logits(logits, Sampling(temperature=1.0, top_k=2), g).item() for _ in range(200)])
    assert set(top2.tolist()) <= {2, 3}


def test_chunks_shrink_where_the_index_scores_would_pass_their_budget(model) -> None:
    """The chunk a prefill runs at a position: the engine's, halved while its queries' scores
    over the records they may see pass the budget, never below the floor; the default is the
    device's (512 on the CPU)."""
    import model.engine as engine_mod

    engine = Engine(model, chunk=512)
    assert Engine(model).chunk == engine_mod.CPU_CHUNK == 512
    assert engine.chunk_at(0) == 512
    ratio = min(r for r in model.args.ratios if r)
    assert engine.score_budget == 4 << 30
    assert engine.score_bytes == engine_mod.SCORE_BYTES_PER  # the CPU sorts; CUDA's select kernel takes less
    want = engine_mod.SELECT_BYTES_PER if kernels.triton_available() else engine_mod.SCORE_BYTES_PER
    assert engine_mod.score_bytes("cuda") == want and engine_mod.SELECT_BYTES_PER < engine_mod.SCORE_BYTES_PER
    engine.score_budget = 512 * 4096 // ratio * engine_mod.SCORE_BYTES_PER
    assert engine.chunk_at(4096 - 512) == 512 and engine.chunk_at(4096) == 256
    assert engine.chunk_at(10 ** 7) == engine_mod.MIN_CHUNK
    sizes = [c.shape[1] for c, _, _ in engine._chunks(ids_of(1000), None, None, start=4000)]
    assert sizes == [256, 256, 256, 232]
