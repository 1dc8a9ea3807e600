"""Training the DSpark draft stages (model.draft_training): the training forward is the
decoding forward, the samples are the model's own greedy replies, the acceptance it counts
is what greedy speculation accepts, and training raises it."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.draft_training import (BlockWindows, add_draft_stages, draft_losses, draft_parameters, pick_anchors,
                                  prefix_run, reply_spans, self_distilled)
from model.dspark import DraftContext, Speculator, has_draft_stages
from model.engine import Engine, Sampling
from model.layer import Step
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build
from model.training import Example, add_weight_qat, quantised_weights
from tests.test_dspark import one_thread  # noqa: F401  (autouse: one intra-op thread)

# a 4-layer model of 12 ids without Engram or vision: the noise id 7 and EOS 1 are ids of it
SMALL = ModelArgs.preset("tiny").replace(
    sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2, vocab_size=12,
    engram_layer_ids=(), engram_num_embeddings=(), vision=None, head_dim=128, num_hidden_layers=4,
    compress_ratios=(0, 2, 1, 1), hc_sinkhorn_iters=3, kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2),
    candidate_source_layer_id=2, dspark_target_layer_ids=(1, 2, 3), num_nextn_predict_layers=0)
EOS = SMALL.eos_token_id


def small_model(seed: int = 3):
    model = build(SMALL, seed=seed)
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    return model.eval()


def conversation(seed: int, turns: int = 2, prompt: int = 30, reply: int = 12) -> Example:
    """Prompts of random ids, each followed by a written reply (random ids, then EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids, trained = [], []
    for _ in range(turns):
        p = torch.randint(2, 12, (prompt,), generator=g).tolist()
        r = torch.randint(2, 12, (reply,), generator=g).tolist() + [EOS]
        ids += p + r
        trained += [False] * len(p) + [True] * len(r)
    return Example(ids, trained)


@pytest.fixture(scope="module")
def drafted():
    model = add_draft_stages(small_model(), seed=5)
    samples = []
    for seed in range(3):
        got, _ = self_distilled(model, conversation(seed), extra=6)
        samples += got
    return model, samples


def test_stages_are_attached_seeded_and_alone_trainable():
    model = small_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    add_draft_stages(model, seed=5)
    assert has_draft_stages(model) and model.args.num_nextn_predict_layers == 3
    assert len(model.args.compress_ratios) == model.args.num_hidden_layers + 3
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("mtp.") for n in trainable)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    assert not model.mtp[-1].markov_head.head.weight.any()
    with pytest.raises(ValueError, match="already has draft stages"):
        add_draft_stages(model, seed=5)
    trained = {n: p.clone() for n, p in model.mtp.named_parameters()}
    with torch.no_grad():
        next(model.mtp.parameters()).add_(1.0)
    add_draft_stages(model, seed=5, replace=True)  # new stages, seeded as before
    assert all(torch.equal(p, trained[n]) for n, p in model.mtp.named_parameters())
    assert len(model.args.compress_ratios) == model.args.num_hidden_layers + 3
    again = add_draft_stages(small_model(), seed=5)
    assert all(torch.equal(p, q) for p, q in zip(model.mtp.parameters(), again.mtp.parameters()))
    assert set(draft_parameters(model)) < set(model.mtp.parameters())  # the router biases are the balance's


def test_replies_are_the_models_greedy_replies(drafted):
    """Each sample's reply is what plain greedy decoding answers to the conversation before it
    (the written prompts, the model's own earlier replies), and its logits rows are the ones
    that predicted each reply id."""
    model, _ = drafted
    ex = conversation(7)
    samples, counts = self_distilled(model, ex, extra=6)
    (s1, e1), (s2, _) = reply_spans(ex.trained)
    assert counts["replies"] == len(samples) == 2
    first = samples[0].ids[samples[0].reply:].tolist()
    befores = [list(ex.ids[:s1]), list(ex.ids[:s1]) + first + list(ex.ids[e1:s2])]
    engine = Engine(model, mode="exact")
    for s, before in zip(samples, befores):
        reply = s.ids[s.reply:].tolist()
        assert s.start + s.reply == len(before) and s.ids[:s.reply].tolist() == before[s.start:]
        assert s.logits.argmax(-1).tolist() == reply
        state = engine.new_state()
        engine.prefill(state, torch.tensor([before]), mode="exact")
        assert list(engine.generate(state, Sampling(max_new_tokens=len(reply), stop_ids=(EOS,)))) == reply
        assert len(s.taps) == len(s.ids) - 1 and s.taps.shape[1] == 3


def test_a_written_greedy_reply_is_kept_and_the_prefix_forks(drafted):
    model, _ = drafted
    ex = conversation(11, turns=1)
    first, _ = self_distilled(model, ex, extra=6)
    greedy = first[0].ids[first[0].reply:].tolist()
    start = first[0].start + first[0].reply
    written = Example(list(ex.ids[:start]) + greedy, [False] * start + [True] * len(greedy))
    prefix = prefix_run(model, written.ids[:10])
    again, counts = self_distilled(model, written, prefix=prefix, extra=6)
    assert counts == {"replies": 1, "as_written": 1, "generated": 0}
    assert torch.equal(again[0].ids, first[0].ids)
    assert torch.allclose(again[0].taps, first[0].taps, atol=1e-5)
    assert torch.allclose(again[0].logits, first[0].logits, atol=1e-4)


def test_the_training_forward_is_the_decoding_forward(drafted):
    """Blocks run many at once through BlockWindows give the hidden that decoding's one block
    gets from a DraftContext filled with the same taps."""
    model, samples = drafted
    mtp, layers = model.mtp, model.args.dspark_target_layer_ids
    anchors = [list(s.anchors)[:3] for s in samples]
    with torch.no_grad():
        many = mtp.hidden_rows(model, torch.stack([s.ids[a] for s, mine in zip(samples, anchors) for a in mine]),
                               Step(0, model.args.dspark_block_size), BlockWindows(mtp, samples, anchors))
        row = 0
        for s, mine in zip(samples, anchors):
            for a in mine:
                ctx = DraftContext(model.args, model.device, spare=model.args.dspark_block_size + 1)
                mtp.add_context(ctx, {layer: s.taps[None, :a, k] for k, layer in enumerate(layers)}, s.start,
                                model.ropes)
                one = mtp.hidden(model, int(s.ids[a]), s.start + a, ctx)
                torch.testing.assert_close(many[row], one, atol=2e-5, rtol=1e-4)
                row += 1


def test_accepted_counts_what_greedy_speculation_accepts(drafted):
    """``accepted`` equals, block by block, the longest prefix of the drafter's greedy
    proposals (DSpark.propose from a DraftContext) that equals the reply."""
    model, samples = drafted
    mtp, layers, S = model.mtp, model.args.dspark_target_layer_ids, model.args.dspark_block_size
    _train(model, samples, steps=15)  # some acceptance to count
    with torch.no_grad():
        counted = draft_losses(model, samples, [list(s.anchors) for s in samples]).accepted
        direct = 0
        for s in samples:
            for a in s.anchors:
                ctx = DraftContext(model.args, model.device, spare=S + 1)
                mtp.add_context(ctx, {layer: s.taps[None, :a, k] for k, layer in enumerate(layers)}, s.start,
                                model.ropes)
                block = mtp.propose(model, int(s.ids[a]), s.start + a, ctx, S, Sampling(), None)
                truth = s.ids[a + 1:a + 1 + S].tolist()
                direct += next((i for i, (p, t) in enumerate(zip(block.tokens, truth)) if p != t),
                               min(len(truth), len(block.tokens)))
    assert counted == direct > 0


def _train(model, samples, steps: int, seed: int = 0) -> list[float]:
    add_weight_qat(model, only="mtp.")
    model.train()
    opt = torch.optim.AdamW(draft_parameters(model), lr=3e-3)
    rng, losses = random.Random(seed), []
    for _ in range(steps):
        opt.zero_grad()
        with quantised_weights(model):
            got = draft_losses(model, samples, pick_anchors(samples, 4, rng))
            got.total.backward()
        opt.step()
        losses.append(float(got.total.detach()))
    model.eval()
    return losses


def test_training_lowers_the_loss_and_raises_acceptance():
    model = add_draft_stages(small_model(seed=4), seed=6)
    samples = []
    for seed in range(20, 24):
        samples += self_distilled(model, conversation(seed), extra=6)[0]
    every = [list(s.anchors) for s in samples]
    with torch.no_grad():
        before = draft_losses(model, samples, every)
    _train(model, samples, steps=40, seed=1)
    with torch.no_grad(), quantised_weights(model):
        after = draft_losses(model, samples, every)
    assert float(after.total) < 0.7 * float(before.total)
    assert after.accepted > before.accepted
    assert after.confidence_mean != pytest.approx(0.5)  # the head left its start


def test_drafts_stage_writes_the_model_with_trained_stages(tmp_path, capsys):
    """``train_default.py --stage drafts`` on the embedded default: its greedy replies, the
    stages trained, the checkpoint written with them, TRAINING.json telling the stage."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train_default

    default = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"
    train_default.main(["--stage", "drafts", "--init", str(default), "--out", str(tmp_path), "--draft-records", "2",
                        "--draft-held-out", "1", "--max-steps", "2", "--log-every", "1", "--workers", "1",
                        "--draft-batch", "2", "--warmup", "1"])
    printed = capsys.readouterr().out
    assert "has draft stages: training new ones in their place" in printed  # the default ships trained ones
    lines = [json.loads(x) for x in printed.splitlines() if x.startswith("{")]
    assert lines[0]["replies"] >= 2 and lines[1]["held_out_blocks"] > 0
    info = json.loads((tmp_path / "model" / "TRAINING.json").read_text())
    assert info["drafts"]["steps"] == 2 and info["drafts"]["init"] == str(default)
    assert info["runs"] == json.loads((default / "TRAINING.json").read_text())["runs"]
    assert (tmp_path / "drafts").is_dir()  # the distilled replies, for a rerun
    from model.loading import load

    model = load(tmp_path / "model")
    assert has_draft_stages(model) and model.args.num_nextn_predict_layers == 3
    Speculator(model, Engine(model))  # speculation is on offer


def test_bench_on_replies_reports_speculation_beside_plain(drafted):
    """``bench_speculative_replies``: both ways' tokens and rates, per verify the accepted
    proposals and emitted tokens (one more: the bonus), the block length chosen."""
    from model.bench import bench_speculative_replies

    model, _ = drafted
    prompts = [(torch.tensor([conversation(seed, turns=1).ids[:30]]), None, 12) for seed in (40, 41)]
    got = bench_speculative_replies(model, prompts, stop_ids=(EOS,), repeats=1)
    assert got["replies"] == 2 and 0 <= got["replies_differing"] <= 2
    assert got["plain_tokens"] > 0 and got["spec_tokens"] > 0 and got["verify_forwards"] > 0
    assert got["tokens_per_verify"] == pytest.approx(got["accepted_per_verify"] + 1)
    assert 1 <= got["block_length"] <= model.args.dspark_block_size
    assert got["verify_over_decode"] > 0 and got["speedup"] == pytest.approx(
        got["spec_tokens_per_s"] / got["plain_tokens_per_s"])
    sampled = bench_speculative_replies(model, prompts, stop_ids=(EOS,), repeats=1, temperature=1.0)
    assert sampled["temperature"] == 1.0 and sampled["verify_forwards"] > 0
    assert sampled["tokens_per_verify"] == pytest.approx(sampled["accepted_per_verify"] + 1)


def test_bench_cli_speculative_on_the_embedded_default(tmp_path, monkeypatch):
    """`dsagent bench decode --speculative` on the shipped default: the evaluation's replies,
    the same greedy tokens both ways; a preset without stages is told so."""
    from typer.testing import CliRunner

    import dsagent.cli as cli

    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(cli.app, ["bench", "decode", "--speculative", "--cases", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["replies"] == 6 and out["replies_differing"] == 0 and out["plain_tokens"] == out["spec_tokens"]
    assert out["accepted_per_verify"] > 1.0 and out["cases"].startswith("1 per skill")
    r = CliRunner().invoke(cli.app, ["bench", "decode", "--speculative", "--preset", "tiny", "--ctx", "16"])
    assert r.exit_code != 0 and "no DSpark draft stages" in r.output
