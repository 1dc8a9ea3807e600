"""Tests of model/training.py: the training forward pass is the serving function.

- a TRAIN-format cache gives the same logits as the packed cache (QAT KV is exact);
- QAT weights read exactly as the written checkpoint will;
- a row simulating CED bounded replay predicts exactly what ``Engine`` CED prefill does;
- the shared-prefix batching and chunking do not change the loss;
- every trainable parameter gets a gradient (indexer: from its KL only);
- the trainer's state round-trips through safetensors (resume).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parametrize

from dsagent.corpus import make_record
from model.checkpoint import fake_quantize_like_checkpoint
from model.engine import Engine
from model.loading import build, load
from model.args import ModelArgs
from model.quant import KVFormat
from model.tokenizer import Tokenizer
from model.training import (Example, ExpertLoads, add_weight_qat, batch_for, batch_loss, common_prefix,
                            plain_state_dict, remove_weight_qat)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load("tiny", seed=3)


def _ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n,), generator=g).tolist()


def _batch(model, examples, modes, seed=0):
    return batch_for(model.args, examples, modes, random.Random(seed))


def test_train_format_cache_gives_the_packed_logits(tiny):
    ids = torch.tensor([_ids(300, 1)])
    with torch.no_grad():
        packed = tiny(ids, tiny.new_cache(1))
        train = tiny(ids, tiny.new_cache(1, kv=KVFormat.TRAIN))
        unquantised = tiny(ids, tiny.new_cache(1, kv=KVFormat.FLOAT))
    torch.testing.assert_close(train, packed, rtol=1e-4, atol=1e-4)
    assert (unquantised - packed).abs().max() > 1e-3  # FLOAT really skips the quantisers


@pytest.mark.parametrize("gathered", [False, True], ids=["dense-mask", "gathered"])
def test_the_training_forward_selects_the_records_inference_does(tiny, gathered, monkeypatch):
    """Training reads each query's picks gathered, as inference does, or (``GATHERED_TRAINING``
    off, and the indexer's dense warm-up) every record under a mask of its picks (the
    dense-mask form). Early queries see fewer records than top-k, so their picks end in -1s:
    those once landed on record 0 as False and dropped it from the mask (CPU: always; CUDA:
    as the writes fell) — the logits differed by 0.2-3.0 at every position of this random
    model. Same logits now (float KV: TRAIN's FP4 rounding turns the two forms' float order
    into ~1e-3 here)."""
    import model.block as block

    monkeypatch.setattr(block, "GATHERED_TRAINING", gathered)
    ids = torch.tensor([_ids(60, 5)])
    assert tiny.args.index_topk * min(r for r in tiny.args.ratios if r > 1) > 30  # early picks hold -1s

    def logits(training_form: bool) -> torch.Tensor:
        cache = tiny.new_cache(1, kv=KVFormat.FLOAT)
        streams, pre, step = tiny.begin(ids, cache, 0)
        step.index_losses = [] if training_form else None
        streams, pre = tiny.run_layers(streams, pre, step, cache, range(tiny.args.num_hidden_layers))
        return tiny.logits(streams, pre)

    with torch.no_grad():
        torch.testing.assert_close(logits(True), logits(False), rtol=1e-5, atol=1e-5)


def test_quantised_weights_are_the_per_weight_values_computed_in_stacks():
    """quantised_weights computes every QAT weight up front, stacked by format and shape:
    the same values (bit for bit) and gradients as one weight at a time, no quantiser
    operation left when a weight is read inside, and nothing kept after it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.training import quantised_weights

    model = load("tiny", seed=4)
    add_weight_qat(model)
    linears = {n: m for n, m in model.named_modules() if parametrize.is_parametrized(m, "weight")}
    with parametrize.cached():
        one_by_one = {n: m.weight.detach().clone() for n, m in linears.items()}

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in ("view", "alias", "detach"):
                Ops.count += 1
            return func(*args, **(kwargs or {}))

    with quantised_weights(model):
        with Ops():
            stacked = {n: m.weight for n, m in linears.items()}
        assert Ops.count == 0  # every value was ready
        assert all(torch.equal(stacked[n], one_by_one[n]) for n in linears) and len(linears) > 400
        loss = sum((w.float() ** 2).sum() for w in stacked.values())
        loss.backward()
    grads = {n: m.parametrizations.weight.original.grad.clone() for n, m in linears.items()}
    assert all(m.parametrizations.weight[0].ready is None for m in linears.values())
    for n, m in linears.items():  # straight-through: d(sum q^2)/dw = 2q
        torch.testing.assert_close(grads[n], 2 * one_by_one[n].float().to(grads[n].dtype), msg=n)


def test_weight_qat_reads_what_the_checkpoint_stores():
    model = build(ModelArgs.preset("tiny"), seed=5)
    expected = fake_quantize_like_checkpoint(model.state_dict())
    assert add_weight_qat(model) > 100
    got = {}
    for name, _ in plain_state_dict(model).items():
        module_name, _, attr = name.rpartition(".")
        got[name] = getattr(model.get_submodule(module_name), attr).detach()
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    remove_weight_qat(model)
    assert set(model.state_dict()) == set(expected)


def test_ced_row_predicts_what_ced_prefill_serves(tiny):
    """Bounded replay simulated by window floors == Engine's CED prefill (same token count,
    since on a random model even float noise from another matmul shape is amplified)."""
    a = tiny.args
    n_prompt = 400
    ids = _ids(n_prompt + 3, 7)
    batch = _batch(tiny, [Example(ids, [False] * n_prompt + [True] * 3)], ["ced"])
    assert batch.floor[0, : a.decoder_start].eq(-1).all()
    assert batch.floor[0, a.decoder_start:].eq(n_prompt - a.sliding_window).all()
    assert batch.loss_mask[0].nonzero().flatten().tolist() == [400, 401, 402]
    prompt = torch.tensor([ids[:n_prompt]])
    cache = tiny.new_cache(1, kv=KVFormat.TRAIN)
    with torch.no_grad():
        streams, pre, step = tiny.begin(prompt, cache, 0)
        step.floor = batch.floor
        streams, pre = tiny.run_layers(streams, pre, step, cache, range(a.num_hidden_layers))
        simulated = tiny.logits(streams[:, -1:], pre[:, -1:])[:, 0]
        engine = Engine(tiny, mode="ced", chunk=1024)  # one pass, as above
        served = engine.prefill(engine.new_state(), prompt)
        exact = Engine(tiny, mode="exact").prefill(engine.new_state(), prompt)
    torch.testing.assert_close(simulated, served, rtol=1e-5, atol=1e-5)
    assert (exact - served).abs().max() > 1e-3  # the floor matters: CED is not exact here


def test_shared_prefix_leaves_the_loss_unchanged(tiny):
    """The prefix run once on one row and repeated == every row running it (same chunk
    boundaries: on a random model other boundaries already move the loss by float noise)."""
    prefix = _ids(200, 11)
    rows = [Example(prefix + _ids(60 + 20 * i, 20 + i), [False] * 200 + [True] * (60 + 20 * i)) for i in range(3)]
    batch = _batch(tiny, rows, ["exact", "ced", "resume"])
    shared_len = common_prefix(batch)
    assert 0 < shared_len <= 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with two, the two losses differed in their sixth digit (order of sums)
    try:
        with torch.no_grad():
            shared = batch_loss(tiny, batch, chunk=shared_len)
            separate = batch_loss(tiny, batch, chunk=shared_len, share_prefix=False)
    finally:
        torch.set_num_threads(threads)
    assert shared.tokens == separate.tokens == 60 + 80 + 100
    assert float(shared.lm) == float(separate.lm)
    # the indexer KL is a mean over (layer, chunk) terms; a prefix chunk holds one row instead of three
    assert abs(float(shared.index) - float(separate.index)) < 0.02 * float(separate.index)


def test_a_row_weight_counts_its_tokens_that_many_times(tiny):
    """Example.weight: the batch's loss sums each row's cross-entropy times its weight over
    the trained token count — each row's part (the others weighted 0) recombines to it."""
    rows = [Example(_ids(90, 30 + i), [False] * 60 + [True] * 30) for i in range(2)]

    def loss(*weights):
        for ex, w in zip(rows, weights):
            ex.weight = w
        batch = _batch(tiny, rows, ["exact", "exact"])
        with torch.no_grad():
            return batch, batch_loss(tiny, batch)

    plain_batch, plain = loss(1.0, 1.0)
    weighted_batch, weighted = loss(1.0, 3.0)
    first, second = float(loss(1.0, 0.0)[1].lm), float(loss(0.0, 1.0)[1].lm)
    assert plain_batch.weights is None and weighted_batch.weights.tolist() == [1.0, 3.0]
    assert weighted.tokens == plain.tokens == 60 and first > 0 and second > 0
    torch.testing.assert_close(float(plain.lm), first + second, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float(weighted.lm), first + 3 * second, rtol=1e-5, atol=1e-6)


def test_every_parameter_learns(tiny):
    model = build(tiny.args, seed=1)
    model.hasher = tiny.hasher
    add_weight_qat(model)
    from PIL import Image
    img = Image.new("RGB", (126, 126), (200, 30, 30))
    span = model.encode_image(img).shape[0]
    ids = _ids(150, 4) + [tiny.args.image_token_id] * span + _ids(40, 5)
    trained = [False] * (150 + span) + [True] * 40
    ex = Example(ids, trained, images=[(150, img)])
    loads = ExpertLoads(model)
    with parametrize.cached():
        losses = batch_loss(model, _batch(model, [ex, ex], ["exact", "resume"]), chunk=96, dense=True)
        losses.total.backward()
    assert losses.index > 0 and losses.tokens == 2 * 40
    silent = [n for n, p in model.named_parameters()
              if (p.grad is None or p.grad.abs().sum() == 0) and not n.endswith(("gate.bias", "gate.bias_vl"))]
    assert silent == []
    before = {n: (g.bias.clone(), g.bias_vl.clone()) for n, g in loads.gates.items()}
    assert loads.update_bias(1e-3) >= 1.0
    assert any(not torch.equal(before[n][0], g.bias) for n, g in loads.gates.items())
    assert any(not torch.equal(before[n][1], g.bias_vl) for n, g in loads.gates.items())  # image tokens


@pytest.mark.parametrize("device, fused", [
    ("cpu", False), ("cpu", True),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_trainer_state_round_trips(tmp_path, tiny, device, fused):
    """A resumed run continues bit for bit: the next AdamW step after load_state equals the
    step the unbroken run takes. Fused AdamW (the trainer's choice on CUDA) wants its step
    counters on the parameters' device: on 2026-11-30 (f73cb93) they were found loaded onto
    the CPU, which stopped every resumed CUDA run at its first step (a CUDA twin of this case
    failed so on the H200 without the fix and passed with it)."""
    import train_default

    def fresh(seed):
        net = build(tiny.args, device=device, seed=seed)
        add_weight_qat(net)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)

    model, opt = fresh(2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    train_default.save_state(tmp_path, model, opt, {"step": 7, "seconds": 1.5, "history": []})
    other, opt2 = fresh(9)
    counters = train_default.load_state(tmp_path, other, opt2)
    assert counters["step"] == 7
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"], rtol=0, atol=0)
        assert opt2.state[q]["step"].device == q.device or not fused
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_trainer_batches_come_from_the_corpus_as_the_agent_logs_it(tiny):
    """make_examples lays corpus records out with image spans expanded; next_batch draws a
    deterministic batch per step (so a resumed run sees the batches it would have seen)."""
    import argparse

    import train_default

    pools = train_default.make_examples(20, 0, tiny.args, workers=1)
    assert len(pools["long"]) == 2 and len(pools["short"]) == 18  # SCHEDULE: one recall record in ten
    with_images = [ex for ex in pools["short"] if ex.images]
    assert with_images and all((ex.ids[s] == tiny.args.image_token_id) for ex in with_images for s, _ in ex.images)
    a = argparse.Namespace(seed=0, long_prob=0.5, short_batch=3, long_batch=2, long_tokens=0)
    first, again = train_default.next_batch(a, pools, 5, tiny.args), train_default.next_batch(a, pools, 5, tiny.args)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.floor, again.floor) and first.modes == again.modes
    assert first.ids.shape[0] in (2, 3) and first.trained_tokens > 0


def test_copy_rows_join_every_short_step(tiny):
    """--copy-rows: the chat, tool and conversation records trained on their copies alone
    ("copied", dsagent.corpus.copy_example) join each short step, none longer than its
    longest row; a step drawn without them is the step it was."""
    import argparse

    import train_default

    pools = train_default.make_examples(40, 2, tiny.args, workers=1, kinds="abf", schedule="abf",
                                         shares={"open_words": 1.0})
    whole = {tuple(ex.ids.tolist()): ex.trained for ex in pools["short"]}
    assert 0 < len(pools["copied"]) < len(pools["short"])  # some chats copy nothing
    for ex in pools["copied"]:  # a record's own ids, trained on a part of its replies
        mask = whole[tuple(ex.ids.tolist())]
        assert 0 < ex.trained.sum() < mask.sum() and not (ex.trained & ~mask).any()
    a = argparse.Namespace(seed=0, long_prob=0.0, short_batch=3, long_batch=2, long_tokens=0, copy_rows=2)
    plain = argparse.Namespace(**{**vars(a), "copy_rows": 0})
    joined, alone = train_default.next_batch(a, pools, 3, tiny.args), train_default.next_batch(plain, pools, 3, tiny.args)
    assert joined.ids.shape[0] == 5 and alone.ids.shape[0] == 3
    assert torch.equal(joined.ids[:3, :alone.ids.shape[1]], alone.ids)  # the step's own rows unchanged
    copied = {tuple(ex.ids.tolist()) for ex in pools["copied"]}
    for row in joined.ids[3:]:
        assert tuple(row[row != tiny.args.pad_token_id].tolist()) in copied


def test_echo_rows_join_every_short_step(tiny):
    """--echo-rows: echo drills (dsagent.corpus.echo_record) trained on their copy alone join
    each short step, split among the processes of a data-parallel run."""
    import argparse

    import train_default

    pools = train_default.make_examples(10, 2, tiny.args, workers=1, kinds="ab", schedule="ab", echo_records=12)
    shares = [train_default.make_examples(10, 2, tiny.args, workers=1, rank=r, world=2, kinds="ab", schedule="ab",
                                          echo_records=12)["echoed"] for r in range(2)]
    drills = {tuple(ex.ids.tolist()) for ex in pools["echoed"]}
    assert len(drills) == 12 and {tuple(ex.ids.tolist()) for s in shares for ex in s} == drills
    assert [len(s) for s in shares] == [6, 6] and not train_default.make_examples(10, 2, tiny.args, workers=1)["echoed"]
    assert all(0 < ex.trained.sum() < 40 for ex in pools["echoed"])
    a = argparse.Namespace(seed=0, long_prob=0.0, short_batch=3, long_batch=2, long_tokens=0, echo_rows=2)
    joined = train_default.next_batch(a, pools, 3, tiny.args)
    assert joined.ids.shape[0] == 5
    for row in joined.ids[3:]:
        assert tuple(row[row != tiny.args.pad_token_id].tolist()) in drills


def test_data_parallel_shares_hold_every_kind(tiny):
    """Each process of a data-parallel run gets whole rounds of the schedule (recall too)."""
    import train_default

    shares = [train_default.make_examples(40, 0, tiny.args, workers=1, rank=r, world=2) for r in range(2)]
    assert [(len(s["short"]), len(s["long"]), len(s["bare"]), len(s["image"])) for s in shares] == [(18, 2, 2, 4)] * 2
    ids = [tuple(ex.ids.tolist()) for s in shares for pool in ("short", "long") for ex in s[pool]]
    assert len(set(ids)) == 40  # disjoint shares covering the 40 records ("bare" and "image" are views of them)


def test_recall_records_enlarge_the_recall_pool_alone(tiny):
    """--recall-records N: the recall pool holds N records, the schedule's share of --records
    plus the recall records that follow them (distinct, none of the first records again);
    the other kinds are unchanged, and data-parallel shares split the extra ones too."""
    import train_default

    base = train_default.make_examples(20, 0, tiny.args, workers=1, kinds="ad", recall_tokens=(40, 80))
    more = train_default.make_examples(20, 0, tiny.args, workers=1, kinds="ad", recall_tokens=(40, 80),
                                       recall_records=5)
    assert (len(base["long"]), len(more["long"]), len(more["bare"])) == (2, 5, 5)
    assert [ex.ids.tolist() for ex in more["short"]] == [ex.ids.tolist() for ex in base["short"]]
    recalled = {tuple(ex.ids.tolist()) for ex in more["long"]}
    assert len(recalled) == 5 and {tuple(ex.ids.tolist()) for ex in base["long"]} < recalled
    shares = [train_default.make_examples(20, 0, tiny.args, workers=1, rank=r, world=2, kinds="d",
                                          recall_tokens=(40, 80), recall_records=6) for r in range(2)]
    split = [{tuple(ex.ids.tolist()) for ex in s["long"]} for s in shares]
    assert [len(x) for x in split] == [3, 3] and not split[0] & split[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_two_process_run(rank: int, port: int) -> None:
    """The environment torchrun gives the ``rank``-th of two processes on one node."""
    import os

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class _Weights(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("w", w)


def _mean_grads_worker(rank: int, port: int, out: str, device: str = "cpu", via_host: bool = False) -> None:
    import train_default

    _join_two_process_run(rank, port)
    group = train_default.Group(device)
    group.via_host = group.via_host or via_host
    a, b, c = (torch.nn.Parameter(torch.zeros(3, device=group.device)) for _ in range(3))
    a.grad = torch.full((3,), float(rank + 1), device=group.device)  # 1 and 2: mean 1.5
    if rank == 1:
        b.grad = torch.full((3,), 4.0, device=group.device)  # only one process has it: mean 2.0 on both
    group.mean_grads([a, b, c])
    w = torch.full((2,), float(rank), device=group.device)  # rank 0's weights reach every process
    group.same_weights(_Weights(w))
    skipped = group.step_outcome(train_default.DONE if rank == 0 else train_default.SKIPPED)
    failed = group.step_outcome(train_default.FAILED if rank == 0 else train_default.SKIPPED)
    torch.save({"a": a.grad.cpu(), "b": b.grad.cpu(), "c": c.grad, "outcomes": (skipped, failed),
                "w": w.cpu(), "device": group.device, "via_host": group.via_host}, f"{out}.{rank}")
    group.close()


def _spawn_mean_grads(tmp_path, device: str = "cpu", via_host: bool = False) -> list[dict]:
    import torch.multiprocessing as tmp

    import train_default

    port = _free_port()
    tmp.spawn(_mean_grads_worker, args=(port, str(tmp_path / "g"), device, via_host), nprocs=2)
    got = [torch.load(tmp_path / f"g.{rank}") for rank in range(2)]
    for g in got:
        assert torch.equal(g["a"], torch.full((3,), 1.5)) and torch.equal(g["b"], torch.full((3,), 2.0))
        assert g["c"] is None and torch.equal(g["w"], torch.zeros(2))
        assert g["outcomes"] == (train_default.SKIPPED, train_default.FAILED)  # each step's worst, in every process
    return got


@pytest.mark.parametrize("via_host", [False, True])
def test_data_parallel_group_averages_gradients(tmp_path, via_host):
    """Two gloo processes: gradients are averaged, one present on a single process reaches
    both, one absent everywhere stays absent, a failed step is failed for all, and rank 0's
    weights reach both — also through host copies, as processes sharing a GPU sum."""
    _spawn_mean_grads(tmp_path, via_host=via_host)


def test_processes_spread_over_the_gpus_and_share_them_through_gloo():
    """Each process of a node takes a GPU in turn; NCCL only where none shares one."""
    import train_default

    assert train_default.process_device(0, 1, 1) == ("cuda:0", "nccl")
    assert train_default.process_device(1, 2, 2) == ("cuda:1", "nccl")
    assert [train_default.process_device(r, 4, 1) for r in range(4)] == [("cuda:0", "gloo")] * 4
    assert [train_default.process_device(r, 4, 2)[0] for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    with pytest.raises(SystemExit, match="no CUDA device"):
        train_default.process_device(0, 2, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_data_parallel_group_on_cuda(tmp_path):
    """Two processes on the GPUs here (both on one GPU, through gloo, where there is one)."""
    got = _spawn_mean_grads(tmp_path, device="cuda")
    assert [g["via_host"] for g in got] == [torch.cuda.device_count() < 2] * 2
    assert [g["device"] for g in got] == [f"cuda:{r % torch.cuda.device_count()}" for r in range(2)]


def test_recall_records_can_start_shorter(tiny):
    """--recall-tokens shortens the trainer's recall logs; the default (the eval's) is unchanged."""
    import train_default

    short = train_default.make_examples(10, 0, tiny.args, workers=1, recall_tokens=(300, 400))["long"][0]
    full = train_default.make_examples(10, 0, tiny.args, workers=1)["long"][0]
    assert len(short.ids) < 2090 + 600 and len(full.ids) > 2090 + 2000  # the system prompt is ~2,090 tokens


def test_log_spread_recall_lengths_and_like_length_batches(tiny):
    """--recall-spread log draws each record's log length log-uniformly (deterministic per
    record: every octave of LO..HI gets its share); --long-tokens batches recall records of
    like length within the token budget."""
    import argparse

    import train_default

    lengths = [train_default.recall_length(0, i, 64, 4096, "log") for i in range(2000)]
    assert all(lo == hi for lo, hi in lengths) and lengths == [train_default.recall_length(0, i, 64, 4096, "log")
                                                               for i in range(2000)]
    octaves = [sum(1 for n, _ in lengths if 64 * 2 ** k <= n < 128 * 2 ** k) for k in range(6)]
    assert min(octaves) > 2000 / 6 * 0.8 and max(octaves) < 2000 / 6 * 1.2, octaves
    assert train_default.recall_length(0, 3, 64, 4096, "uniform") == (64, 4096)

    pools = train_default.make_examples(60, 0, tiny.args, workers=1, recall_tokens=(20, 2000), spread="log")
    sizes = [len(ex.ids) for ex in pools["long"]]
    assert sizes == sorted(sizes) and sizes[-1] - sizes[0] > 500  # sorted, and the lengths do spread
    a = argparse.Namespace(seed=0, long_prob=1.0, short_batch=3, long_batch=2, long_tokens=3 * sizes[-1])
    batches = [train_default.next_batch(a, pools, step, tiny.args) for step in range(12)]
    assert all(b.ids.shape[0] * b.ids.shape[1] <= a.long_tokens for b in batches)
    assert max(b.ids.shape[0] for b in batches) >= 3  # short records fill the budget with more rows

    # --short-tokens: a short step keeps the rows that fit the budget (rows x longest row)
    a = argparse.Namespace(seed=0, long_prob=0.0, short_batch=6, long_batch=2, long_tokens=0)
    lengths = [len(ex.ids) for ex in pools["short"]]
    assert 2 * min(lengths) > max(lengths)  # so six rows never fit three of the longest, and three always do
    a.short_tokens = budget = 3 * max(lengths)
    for step in range(8):
        batch = train_default.next_batch(a, pools, step, tiny.args)
        assert batch.ids.shape[0] * batch.ids.shape[1] <= budget and 3 <= batch.ids.shape[0] < 6
    a.short_tokens = 0
    assert all(train_default.next_batch(a, pools, step, tiny.args).ids.shape[0] == 6 for step in range(8))
    rows = sorted(pools["short"], key=lambda ex: len(ex.ids))[:5]
    n = len(rows[-1].ids)
    assert train_default.within_budget(rows, 1, 3 * n) == rows[:2]  # (2 + 1) rows of at most n
    assert train_default.within_budget(rows, 0, 1) == rows[:1]  # one row even over the budget

    # step_kind (also the trainer's recall-accuracy split) names the pool next_batch drew from
    a = argparse.Namespace(seed=0, long_prob=0.4, image_prob=0.3, short_batch=3, long_batch=2, long_tokens=0,
                           image_batch=5)
    kinds = [train_default.step_kind(a, pools, step) for step in range(40)]
    assert {"long", "image", "short"} == set(kinds)
    for step, kind in enumerate(kinds):
        batch = train_default.next_batch(a, pools, step, tiny.args)
        assert batch.ids.shape[0] == {"long": 2, "image": 5, "short": 3}[kind]
        if kind == "image":
            assert (batch.ids == tiny.args.image_token_id).any(-1).all()  # every row holds an image

    # --recall-first: the first steps all train on bare recall records, the shortest half only
    a.recall_first = "6,0.5"
    for step in range(6):
        assert train_default.step_kind(a, pools, step) == "long"
        batch = train_default.next_batch(a, pools, step, tiny.args)
        bare = [len(ex.ids) for ex in pools["bare"]]  # the same records without the system prompt
        assert batch.ids.shape[0] == 2 and batch.ids.shape[1] <= bare[len(bare) // 2 - 1] < sizes[0]
    assert [train_default.step_kind(a, pools, step) for step in range(6, 40)] == kinds[6:]
    a.recall_first = "6,0"
    with pytest.raises(SystemExit, match="SHARE"):
        train_default.next_batch(a, pools, 0, tiny.args)


def test_gathered_training_records_give_the_dense_mask_forms_losses_and_gradients(tiny, monkeypatch):
    """A training step that reads each query's top-k records gathered gives the losses and
    every gradient of the step that masks all records (the form it replaced), to float order
    (float KV: with TRAIN's FP4 records a rounding flips on that order, ~4e-4 of the loss);
    rows past the window, so the records carry the loss. Tokens free of near-ties in the
    indexers' scores: on some (seeds 5 and 6) float order alone moves an indexer's gradient by
    ~8e-4 in either window form, dense or banded; on these the worst parameter is 1e-5 to
    1.5e-5 with the window dense and in bands of 8, 16 and 128 (2026-12-07)."""
    import model.block as block

    n = 3 * tiny.args.sliding_window
    batch = _batch(tiny, [Example(_ids(n, 11), [False] * (n - 24) + [True] * 24),
                          Example(_ids(n - 40, 12), [False] * (n - 64) + [True] * 24)], ["exact", "ced"])
    out = {}
    for gathered in (False, True):
        monkeypatch.setattr(block, "GATHERED_TRAINING", gathered)
        tiny.zero_grad()
        losses = batch_loss(tiny, batch, share_prefix=False, kv=KVFormat.FLOAT)  # TRAIN's FP4 flips on float order
        (losses.lm + losses.index).backward()
        out[gathered] = (losses.lm.detach(), losses.index.detach(),
                         {k: p.grad.clone() for k, p in tiny.named_parameters() if p.grad is not None})
    tiny.zero_grad()
    (lm0, ix0, g0), (lm1, ix1, g1) = out[False], out[True]
    torch.testing.assert_close(lm1, lm0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ix1, ix0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys() and any("compressor" in k for k in g0)
    errors = {k: ((g1[k] - g0[k]).norm() / g0[k].norm().clamp_min(1e-30)).item() for k in g0}
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda e: -e[1])[:5]


@pytest.mark.parametrize("dense", [True, False])
def test_the_loss_reaches_every_kv_source_through_its_records(tiny, dense):
    """Long-range recall is learnt through the global records: a loss on tokens far past the
    window must send gradients into every compressor that writes them (dense and top-k)."""
    n = 3 * tiny.args.sliding_window
    batch = _batch(tiny, [Example(_ids(n, 5), [False] * (n - 8) + [True] * 8)], ["exact"])
    tiny.zero_grad()
    batch_loss(tiny, batch, dense=dense, share_prefix=False).lm.backward()
    for layer in tiny.args.kv_source_layer_ids:
        grad = tiny.layers[layer].attn.compressor.wkv.weight.grad
        assert grad is not None and grad.abs().sum() > 0, layer
    tiny.zero_grad()


def test_retrieval_drill_trains_only_the_planted_value():
    from retrieval_drill import drill

    from model.loading import BUNDLED_TOKENIZER
    from model.tokenizer import Tokenizer

    tok = Tokenizer.from_file(BUNDLED_TOKENIZER)
    ex = drill(random.Random(3), tok, 60, 90)
    text = tok.decode(ex.ids)
    question, answer = text.rsplit("\nWhat is the ", 1)[1].split("?\n")
    key = question  # e.g. "password of cobalt"
    value = answer.rsplit(" is ", 1)[1].rstrip(".")
    assert f"{key}: {value}" in text.split("\nWhat is")[0]  # planted in the log
    assert tok.decode([i for i, t in zip(ex.ids, ex.trained) if t]) == f"{value}."
    log = text.split("\nWhat is")[0].splitlines()
    assert sum(line.startswith(f"{key.split(' of ')[0]} of ") for line in log) == 3  # the key and two decoys


def test_retrieval_drill_held_out_split_scores_letters_digits_and_values(tiny):
    """The drill's closing evaluation: teacher-forced accuracy of the value's letter tokens,
    digit tokens and whole values, on drills of its own seed; a random model gets ~none."""
    from retrieval_drill import held_out

    from model.tokenizer import Tokenizer

    scores = held_out(tiny, Tokenizer.bundled(), 40, 60, 2)
    positions = scores.pop("positions")  # by position in the value: ABC-1234. a token each
    assert set(scores) == {"letters", "digits", "values"}
    assert all(0.0 <= v <= 1.0 for v in scores.values()) and scores["values"] == 0.0
    assert len(positions) == 9 and all(0.0 <= v <= 1.0 for v in positions)


def test_recall_probe_scores_the_value_tokens_alone(tiny):
    """corpus.value_example trains (scripts/recall_probe.py scores) exactly the reply's value
    tokens, with or without the system prompt; the probe gives a share per range of log lengths."""
    import recall_probe

    from dsagent.corpus import bare_record, value_example

    tok = Tokenizer.bundled()
    record = make_record(recall_probe.HELD_OUT_SEED, 200, "d", tok, (40, 90))
    full, bare = (value_example(r, tok, tiny.args) for r in (record, bare_record(record)))
    for ex in (full, bare):
        scored = [t for t, m in zip(ex.ids, ex.trained) if m]
        assert tok.decode(scored).strip() == record["truth"]["value"]
        assert ex.trained.index(True) > len(ex.ids) - 16  # the reply's copy, not the log's
    for i in range(200, 216):  # every record of the probe: the value is found, whatever its tokens
        ex = value_example(bare_record(make_record(recall_probe.HELD_OUT_SEED, i, "d", tok, (40, 90))), tok, tiny.args)
        assert 3 <= sum(ex.trained) <= 9
    assert len(full.ids) - len(bare.ids) > 2000  # the system prompt
    got = recall_probe.probe(tiny, tok, [(40, 90), (150, 300)], n=2, bare=True)
    assert set(got) == {"40-90", "150-300"} and all(0 <= v <= 1 for v in got.values())
    # a training run's own records (--seed S --indices 7,10): the key and value a record plants
    # do not depend on its log's length, so the probe asks what the run saw, at any length
    short, long = (recall_probe.recall_records(tok, lo, hi, 3, seed=8, indices=(7, 10)) for lo, hi in ((40, 90), (300, 400)))
    assert [r["truth"] for r in short] == [r["truth"] for r in long]
    assert [r["id"] for r in short] == ["8-0000007-d", "8-0000017-d", "8-0000027-d"]
    assert len(long[0]["messages"][1]["content"]) > len(short[0]["messages"][1]["content"])


def test_trainer_profile_counts_each_steps_operations():
    """--profile's summary: per step, the top-level operators (kernels on CUDA) and the wall time."""
    import train_default

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    prof = train_default.StepProfile("cpu")
    for _ in range(3):
        torch.mm(a, b).relu()
        prof.steps += 1
    got = prof.finish()
    assert got["steps"] == 3 and got["unit"] == "operator" and got["launches_per_step"] == 2
    assert {t["name"] for t in got["top"]} == {"aten::mm", "aten::relu"} and got["wall_ms_per_step"] > 0


def test_image_drill_rows_are_image_conversations(tiny):
    """scripts/image_drill.py trains on image conversations, by default without the system
    prompt: one picture a row, its span of image tokens, and a trained reply; --form-share
    narrows about that share of them to the kind and count words; --prompted puts the same
    conversations behind the system prompt."""
    import image_drill

    tok = Tokenizer.bundled()
    rows = image_drill.image_examples(image_drill.DRILL_SEED, 3, tok, tiny.args)
    for ex in rows:
        assert len(ex.images) == 1 and (torch.tensor(ex.ids) == tiny.args.image_token_id).sum() > 0
        assert len(ex.ids) < 200 and any(ex.trained)  # the ~2.3K-token system prompt is not there
    form = image_drill.image_examples(image_drill.DRILL_SEED, 3, tok, tiny.args, form_share=1.0)
    from dsagent.corpus import NUMBER_WORDS, make_record
    for i, (ex, full) in enumerate(zip(form, rows)):
        truth = make_record(image_drill.DRILL_SEED, i, "c", tok)["truth"]["image"]
        said = tok.decode([t for t, m in zip(ex.ids, ex.trained) if m]).lower()
        assert ex.ids == full.ids and sum(ex.trained) < sum(full.trained)
        assert truth["kind"][:4] in said and NUMBER_WORDS[truth["count"]] in said and truth["colour"] not in said
    half = image_drill.image_examples(image_drill.DRILL_SEED, 40, tok, tiny.args, form_share=0.5)
    whole = image_drill.image_examples(image_drill.DRILL_SEED, 40, tok, tiny.args)
    narrowed = [sum(h.trained) < sum(w.trained) for h, w in zip(half, whole)]
    assert 10 <= sum(narrowed) <= 30 and all(h.ids == w.ids for h, w in zip(half, whole))
    # --prompted: the same conversations behind the system prompt, one shared prefix, the same replies
    prompted = image_drill.image_examples(image_drill.DRILL_SEED, 3, tok, tiny.args, prompted=True)
    prefix = len(prompted[0].ids) - len(rows[0].ids)
    assert prefix > 1000
    for ex, bare in zip(prompted, rows):
        assert ex.ids[:prefix] == prompted[0].ids[:prefix] and ex.ids[-len(bare.ids) + 1:] == bare.ids[1:]
        assert ex.trained[-len(bare.ids) + 1:] == bare.trained[1:] and not any(ex.trained[:prefix])


def test_image_drill_tower_only_leaves_the_language_model_bit_for_bit(tmp_path):
    """--tower-only --prompted --save: the written checkpoint's language model is the one it started
    from, bit for bit (so text is answered as before); its vision tower has moved."""
    import image_drill

    out = tmp_path / "drilled"
    image_drill.main(["--init", str(DEFAULT), "--steps", "1", "--batch", "2", "--records", "4", "--lr", "1e-2",
                      "--tower-only", "--prompted", "--save", str(out)])
    before, after = (dict(load(p).named_parameters()) for p in (DEFAULT, out))
    tower = [n for n in before if n.startswith(image_drill.TOWER)]
    assert len(tower) > 10 and len(before) - len(tower) > 100
    assert all(torch.equal(before[n], after[n]) for n in before if n not in tower)
    assert sum(not torch.equal(before[n], after[n]) for n in tower) > len(tower) // 2
    info = json.loads((out / "TRAINING.json").read_text())
    assert info["tower_only"] and info["prompted"] and info["steps"] == 1 and info["command"].startswith("python3 scripts/image_drill.py")


def test_vit_probe_separates_what_is_separable_and_reads_each_cell(tiny):
    """scripts/vit_probe.py: its probe finds a linearly separable label (and not a random
    one); its features are the image's 3x3 cell embeddings, flattened."""
    import random as _random

    import vit_probe
    from dsagent.corpus import draw_shapes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 20, generator=g)
    assert vit_probe.probe_accuracy(x, (x[:, 3] > 0).long(), 300) > 0.9
    assert vit_probe.probe_accuracy(x, torch.randint(0, 2, (400,), generator=g), 300) < 0.7
    pictures = [draw_shapes(_random.Random(i)) for i in range(2)]
    assert vit_probe.features(tiny, pictures).shape == (2, 9 * tiny.args.hidden_size)


def test_trainer_recall_rows_join_the_short_steps_and_keep_the_shared_prefix(tiny):
    """--recall-rows K: every short step also trains K recall records with the system prompt,
    on the value alone under --recall-value-only; the rows still share the system prompt."""
    import argparse

    import train_default
    from model.training import common_prefix

    pools = train_default.make_examples(40, 0, tiny.args, workers=1, kinds="ad", value_only=True)
    assert len(pools["valued"]) == len(pools["long"]) == 4
    valued = {tuple(ex.ids.tolist()) for ex in pools["valued"]}
    assert valued == {tuple(ex.ids.tolist()) for ex in pools["long"]}  # same records, other targets
    a = argparse.Namespace(seed=0, long_prob=0.0, short_batch=3, long_batch=2, long_tokens=0, recall_rows=2)
    batch = train_default.next_batch(a, pools, 5, tiny.args)
    rows = [tuple(r[r != tiny.args.pad_token_id].tolist()) for r in batch.ids]
    assert len(rows) == 5 and all(r in valued for r in rows[3:]) and not any(r in valued for r in rows[:3])
    value_only = {tuple(ex.ids.tolist()): int(ex.trained.sum()) for ex in pools["valued"]}
    whole = {tuple(ex.ids.tolist()): int(ex.trained.sum()) for ex in pools["long"]}
    for row, said in zip(rows[3:], batch.loss_mask[3:].sum(1).tolist()):
        assert 0 < said == value_only[row] < whole[row] - 5
    assert common_prefix(batch) > 1000  # the system prompt
    short = train_default.make_examples(40, 0, tiny.args, workers=1, kinds="ad", value_only=True,
                                        recall_tokens=(20, 900))
    lengths = sorted(len(ex.ids) for ex in short["valued"])
    for step in range(5, 15):
        batch = train_default.next_batch(a, short, step, tiny.args)
        longest = max(int((r != tiny.args.pad_token_id).sum()) for r in batch.ids[:3])
        fits = [n for n in lengths if n <= longest] or lengths[:1]
        assert all(int((r != tiny.args.pad_token_id).sum()) <= fits[-1] for r in batch.ids[3:])  # no longer rows
    assert len(train_default.next_batch(argparse.Namespace(**{**vars(a), "recall_rows": 0}), pools, 5,
                                        tiny.args).ids) == 3


def test_trainer_kinds_replay_weights_and_tower_learning_rate(tiny):
    """--kinds keeps only the records of those kinds; --replay sets the replay modes rows
    simulate (a bad spelling is refused); param_groups gives the ViT and its aligner the
    --tower-lr multiplier, decays matrices only and leaves the router's biases out."""
    import argparse

    import train_default
    from model.training import param_groups

    pools = train_default.make_examples(30, 0, tiny.args, workers=1, kinds="d")
    assert (len(pools["long"]), len(pools["bare"]), len(pools["short"]), len(pools["image"])) == (3, 3, 0, 0)
    valued = train_default.make_examples(30, 0, tiny.args, workers=1, kinds="d", value_only=True)
    tok = Tokenizer.bundled()
    for full, value, prompted in zip(pools["bare"], valued["bare"], valued["long"]):
        assert full.ids.tolist() == value.ids.tolist() and value.trained.sum() < full.trained.sum() - 5
        said = tok.decode([i for i, t in zip(value.ids, value.trained) if t]).strip()
        assert f": {said}\n" in tok.decode(value.ids.tolist()) and prompted.trained.sum() > value.trained.sum()
    a = argparse.Namespace(seed=0, long_prob=1.0, short_batch=3, long_batch=6, long_tokens=0, replay="1,0,0")
    assert train_default.next_batch(a, pools, 3, tiny.args).modes == ["exact"] * 6
    bare = {tuple(ex.ids.tolist()) for ex in pools["bare"]}
    for pool, want in (("prompted", False), ("bare", True)):  # --recall-pool, after the first phase
        rows = train_default.next_batch(argparse.Namespace(**{**vars(a), "recall_pool": pool}), pools, 3, tiny.args)
        assert all((tuple(r[r != tiny.args.pad_token_id].tolist()) in bare) == want for r in rows.ids)
    drawn = [{tuple(r[r != tiny.args.pad_token_id].tolist()) in bare for r in
              train_default.next_batch(argparse.Namespace(**{**vars(a), "recall_pool": "both"}), pools, s,
                                       tiny.args).ids} for s in range(3, 23)]
    assert all(len(d) == 1 for d in drawn) and 3 <= sum(True in d for d in drawn) <= 17  # "both": whole steps, ~half each
    both = argparse.Namespace(**{**vars(a), "recall_pool": "both"})
    assert [True in d for d in drawn] == [train_default.bare_recall_step(both, s) for s in range(3, 23)]
    assert {train_default.step_kind(argparse.Namespace(**{**vars(a), "long_prob": 0.0}), pools, s)
            for s in range(20)} == {"long"}  # nothing else to train on
    a.replay = "0,0,1"
    assert train_default.next_batch(a, pools, 3, tiny.args).modes == ["resume"] * 6
    for bad in ("1,0", "0,0,0", "1,-1,1"):
        with pytest.raises(SystemExit, match="--replay"):
            train_default.next_batch(argparse.Namespace(**{**vars(a), "replay": bad}), pools, 3, tiny.args)

    names = {id(p): n for n, p in tiny.named_parameters()}
    groups = param_groups(tiny, tower_lr=4.0)
    seen = {names[id(p)]: g for g in groups for p in g["params"]}
    assert len(seen) == sum(len(g["params"]) for g in groups)  # each parameter once
    assert {n for n in names.values() if n not in seen} == {n for n in names.values()
                                                            if n.endswith(("gate.bias", "gate.bias_vl"))} != set()
    for n, g in seen.items():
        assert g["scale"] == (4.0 if n.startswith(("vision.", "aligner.")) else 1.0), n
        assert (g["weight_decay"] > 0) == (tiny.get_parameter(n).dim() == 2), n
    assert any(n.startswith("vision.") for n in seen)


def test_chat_drill_rows_and_a_constant_learning_rate(tiny):
    """retrieval_drill --chat trains the corpus's recall conversation without the system
    prompt, its whole reply; the trainer's --decay none keeps the rate after warm-up."""
    import argparse

    import train_default
    from dsagent.corpus import DEFAULT_SYSTEM
    from retrieval_drill import chat_drill

    tok = Tokenizer.bundled()
    ex = chat_drill(random.Random(3), tok, 60, 90, tiny.args)
    valued = chat_drill(random.Random(3), tok, 60, 90, tiny.args, value_only=True)
    assert valued.ids == ex.ids and 3 <= sum(valued.trained) <= 9 < sum(ex.trained)
    text = tok.decode(ex.ids)
    reply = tok.decode([i for i, t in zip(ex.ids, ex.trained) if t])
    assert "<｜User｜>" in text and DEFAULT_SYSTEM[:40] not in text  # no system prompt
    key, value = reply.split("The ", 1)[1].split(" is ", 1)
    assert f"{key}: {value.split('.')[0]}" in text.split("<｜Assistant｜>")[0]
    a = argparse.Namespace(lr=1e-3, warmup=10, decay="none")
    assert [train_default.learning_rate(a, s, p) for s, p in ((4, 0.1), (50, 0.5), (90, 0.99))] == [5e-4, 1e-3, 1e-3]
    a.decay = "cosine"
    assert train_default.learning_rate(a, 90, 0.99) < 2e-4


def test_trainer_logs_bare_recall_steps_apart(tmp_path, capsys):
    """The log's recall_acc counts every recall step's trained tokens (a prompted record's whole
    reply); bare_recall_acc the bare records' steps alone (with --recall-value-only: the values'
    tokens), the measure of the lookup itself."""
    import train_default

    train_default.main(["--out", str(tmp_path / "run"), "--device", "cpu", "--records", "10", "--workers", "1",
                        "--kinds", "d", "--long-batch", "1", "--recall-tokens", "40,90", "--recall-value-only",
                        "--recall-first", "1,1", "--log-every", "1", "--max-steps", "2", "--long-prob", "1"])
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    first, second = entries[:2]
    assert first["step"] == 1 and first["bare_recall_acc"] == first["recall_acc"]  # the recall-first phase
    assert second["step"] == 2 and "bare_recall_acc" not in second and "recall_acc" in second  # prompted


def test_trainer_ends_a_run_whose_steps_keep_running_out_of_memory(tmp_path, capsys, monkeypatch):
    """A step out of memory is skipped; OOM_STREAK of them in a row end the run (checkpoint
    and TRAINING.json written, the reason in it, exit status 1) rather than spend the budget
    skipping, as a 32-row bare phase at ~3K tokens beside two other trainers did (2026-12-02, 89beacf).
    A step that fits resets the count. The CPU raises the CUDA error through a stand-in loss."""
    import train_default

    real, calls = train_default.batch_loss, []

    def fails_after_one(*args, **kwargs):  # the first step fits, every later one runs out of memory
        calls.append(1)
        if len(calls) > 1:
            raise torch.cuda.OutOfMemoryError("stand-in: out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_default, "batch_loss", fails_after_one)
    with pytest.raises(SystemExit, match=f"{train_default.OOM_STREAK} steps in a row ran out of memory"):
        train_default.main(["--out", str(tmp_path / "run"), "--device", "cpu", "--records", "4", "--workers", "1",
                            "--kinds", "a", "--short-batch", "1", "--log-every", "1", "--long-prob", "0",
                            "--max-steps", "100"])
    info = json.loads((tmp_path / "run" / "model" / "TRAINING.json").read_text())
    assert info["steps"] == 1 + train_default.OOM_STREAK and info["skipped_steps"] == train_default.OOM_STREAK
    assert "out of memory" in info["stopped"] and len(calls) == 1 + train_default.OOM_STREAK
    assert f"stopping at step {1 + train_default.OOM_STREAK}" in capsys.readouterr().out


def test_trainer_writes_the_steps_done_when_a_step_fails(tmp_path, capsys, monkeypatch):
    """Any other error of a step (an autograd error, say: a run of 2026-12-06 lost ~590 steps of
    seven minutes to one) ends the run as OOM_STREAK does — the checkpoint of the steps done and
    TRAINING.json written, the step and the error in it, exit status 1 — instead of a traceback
    that writes nothing."""
    import train_default

    real, calls = train_default.batch_loss, []

    def fails_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stand-in: one of the variables needed for gradient computation has been modified")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_default, "batch_loss", fails_third)
    with pytest.raises(SystemExit, match="step 2 .* failed: RuntimeError: stand-in: one of the variables"):
        train_default.main(["--out", str(tmp_path / "run"), "--device", "cpu", "--records", "4", "--workers", "1",
                            "--kinds", "a", "--short-batch", "1", "--log-every", "1", "--long-prob", "0",
                            "--max-steps", "100"])
    info = json.loads((tmp_path / "run" / "model" / "TRAINING.json").read_text())
    assert info["steps"] == 2 and "RuntimeError: stand-in" in info["stopped"] and len(calls) == 3
    assert load(str(tmp_path / "run" / "model")).args.hidden_size == load("tiny").args.hidden_size
    captured = capsys.readouterr()
    assert "stopping at step 2: step 2" in captured.out and "Traceback" in captured.err

def _out_of_memory_worker(rank: int, port: int, out: str) -> None:
    import train_default

    _join_two_process_run(rank, port)

    def runs_out(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("stand-in: out of memory")

    train_default.batch_loss = runs_out
    try:
        train_default.main(["--out", out, "--device", "cpu", "--records", "20", "--workers", "1", "--kinds", "a",
                            "--short-batch", "1", "--log-every", "1", "--long-prob", "0", "--max-steps", "100"])
        ended = "returned"
    except SystemExit as e:
        ended = str(e.code)
    Path(f"{out}.{rank}").write_text(ended)


def test_every_process_of_a_run_stopped_out_of_memory_exits_with_the_reason(tmp_path):
    """Data-parallel, a run stopped by OOM_STREAK steps out of memory ends every process with
    exit status 1 and the reason, not the first alone (the others used to return normally, so
    a launcher saw one failed process of several)."""
    import torch.multiprocessing as tmp

    import train_default

    port = _free_port()
    tmp.spawn(_out_of_memory_worker, args=(port, str(tmp_path / "run")), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"run.{rank}").read_text().startswith(
            f"train_default: {train_default.OOM_STREAK} steps in a row ran out of memory")
    info = json.loads((tmp_path / "run" / "model" / "TRAINING.json").read_text())
    assert info["skipped_steps"] == train_default.OOM_STREAK and info["processes"] == 2
    assert info["command"].startswith("torchrun --standalone --nproc-per-node 2 scripts/train_default.py ")


def test_next_batch_long_tokens_bounds_the_recall_first_phase_too(tiny):
    """With --long-tokens the --recall-first phase draws as many bare records of like length
    as fit the budget (from the shortest SHARE), not --long-batch rows whatever their length."""
    import argparse

    import train_default

    pools = train_default.make_examples(60, 0, tiny.args, workers=1, recall_tokens=(20, 2000), spread="log")
    bare = [len(ex.ids) for ex in pools["bare"]]
    a = argparse.Namespace(seed=0, long_prob=1.0, short_batch=3, long_batch=8, long_tokens=2 * bare[-1],
                           recall_first="12,1")
    batches = [train_default.next_batch(a, pools, step, tiny.args) for step in range(12)]
    assert all(b.ids.shape[0] * b.ids.shape[1] <= a.long_tokens for b in batches)
    assert {b.ids.shape[0] for b in batches} != {8} and max(b.ids.shape[0] for b in batches) >= 3
    a.long_tokens = 0
    assert all(train_default.next_batch(a, pools, step, tiny.args).ids.shape[0] == 8 for step in range(4))


def test_trainer_stops_a_run_and_a_rerun_finishes_the_budget(tmp_path, capsys):
    """`--stop-minutes` ends one invocation with its state and checkpoint written (the device
    lends machines for 10-minute calls); a rerun with the same --out resumes at that step and
    finishes: its checkpoint loads and TRAINING.json counts both runs' steps."""
    import train_default

    common = ["--out", str(tmp_path / "run"), "--device", "cpu", "--records", "4", "--workers", "1",
              "--kinds", "a", "--short-batch", "1", "--log-every", "1", "--long-prob", "0", "--max-steps", "2"]
    train_default.main(common + ["--stop-minutes", "1e-6"])
    first = json.loads((tmp_path / "run" / "state" / "counters.json").read_text())
    assert first["step"] == 1 and "stopping this run at step 1" in capsys.readouterr().out
    assert (tmp_path / "run" / "model" / "TRAINING.json").is_file()
    with pytest.raises(SystemExit, match=r"--lr: 0.002 in the state, 0.0001 now"):
        train_default.main(common + ["--lr", "1e-4"])  # another schedule than the state's: refused
    assert json.loads((tmp_path / "run" / "state" / "counters.json").read_text())["step"] == 1
    train_default.main(common + ["--workers", "2"])  # how it runs may change
    info = json.loads((tmp_path / "run" / "model" / "TRAINING.json").read_text())
    assert info["steps"] == 2 and "resumed at step 1" in capsys.readouterr().out
    assert len(info["reruns"]) == 1 and info["lr"] == 0.002
    assert load(str(tmp_path / "run" / "model")).args.vocab_size == 1024


def test_copy_drill_trains_bare_echo_drills_and_saves_a_checkpoint(tmp_path):
    """scripts/copy_drill.py: echo drills without the system prompt, trained on the copy alone;
    its probes are texts of the evaluation's held-out words, random letters and digits, scored
    on their own kind of token; --save writes a loadable checkpoint and its TRAINING.json."""
    import copy_drill

    from dsagent.corpus import lexicon

    tok, args = Tokenizer.bundled(), load("tiny", seed=3).args
    ex = copy_drill.drill_example(11, 0, tok, args)
    assert len(ex.ids) < 120 and 0 < sum(ex.trained) < 40  # no system prompt; the copy alone
    held = copy_drill.probe_examples("held_out_words", 4, tok, args)
    for row in held:
        said = tok.decode([t for t, m in zip(row.ids, row.trained) if m]).split()
        assert len(said) == 2 and all(lexicon("held-out").drew(w) for w in said)
    copy_drill.main(["--init", "tiny", "--steps", "2", "--batch", "2", "--probe", "2", "--save", str(tmp_path / "m")])
    info = json.loads((tmp_path / "m" / "TRAINING.json").read_text())
    assert info["steps"] == 2 and info["rows"] == 4 and set(info["probe_after"]) == set(copy_drill.PROBES)
    assert load(str(tmp_path / "m")).args.hidden_size == args.hidden_size



def test_a_chunk_that_fits_the_grown_record_buffers_keeps_the_backward_valid(tiny):
    """A record buffer grows by a quarter, so a short chunk (the shared prefix's end) can leave
    room for the next: that chunk's append must not write into a buffer an earlier chunk's
    attention saved for its backward (a run of 2026-12-06 stopped on that error, a recall row
    of 8,287 tokens in chunks ending 4,096, 8,192, 8,249, 8,287). Same chunk ends here at a
    smaller scale. (Other chunk ends give other gradients on a random model, up to 60% apart
    on a compressor: no whole-row reference for these.)"""
    n = 300
    batch = _batch(tiny, [Example(_ids(n, 7), [False] * 262 + [True] * (n - 262))], ["exact"])
    assert common_prefix(batch) == 261  # ends 128, 256, 261, 300: 261 grows the buffers past 300
    tiny.zero_grad()
    loss = batch_loss(tiny, batch, chunk=64, prefix_chunk=128)
    loss.lm.backward()
    for layer in tiny.args.kv_source_layer_ids:
        grad = tiny.layers[layer].attn.compressor.wkv.weight.grad
        assert grad is not None and grad.abs().sum() > 0, layer
    tiny.zero_grad()
    with torch.no_grad():
        whole = batch_loss(tiny, batch, chunk=n, share_prefix=False)
    torch.testing.assert_close(float(loss.lm), float(whole.lm), rtol=1e-4, atol=0)


def test_records_with_gradients_go_to_fresh_buffers_and_plain_ones_to_the_spare_room():
    """SourceKV.append: a view taken before an append of records that carry gradients is never
    written to (autograd checks the buffer's version); without gradients the buffers keep their
    spare quarter, so decode steps and their CUDA graphs keep the same buffers."""
    from model.cache import SourceKV
    src = SourceKV(1, 1, 8, 4, "cpu", kv=KVFormat.TRAIN)
    grown = torch.ones(1, 20, 8, requires_grad=True)
    src.append(grown * 1.0, torch.zeros(1, 20, 4))
    seen, version = src.view()[0], src.records._version
    assert src.records.shape[1] == 20
    src.append(grown[:, :3] * 2.0, torch.zeros(1, 3, 4))
    assert seen._version == version and src.n == 23 and src.records.shape[1] == 23
    assert torch.equal(src.view()[0][0, 20:], torch.full((3, 8), 2.0))
    plain = SourceKV(1, 1, 8, 4, "cpu", kv=KVFormat.TRAIN)
    plain.append(torch.ones(1, 17, 8), torch.zeros(1, 17, 4))
    buffer = plain.records
    assert buffer.shape[1] == 20  # 16 grown by a quarter
    plain.append(torch.ones(1, 3, 8), torch.zeros(1, 3, 4))
    assert plain.records is buffer and plain.n == 20
