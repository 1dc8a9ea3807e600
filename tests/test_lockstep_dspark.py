"""DSpark speculation over two gloo ranks on the CPU (``model.lockstep``): rank 0's speculator
sends each of its model calls and the other rank makes it on its own copy, so two ranks give
one process's ids — greedy (and those of plain greedy decoding), seeded sampling, a reader
that stops in the middle of a verified block — the follower's caches come out byte for byte
rank 0's, and a state or a speculator rank 0 lets go of is sent to be let go of there.

The target is the trained default model (as in ``tests/test_lockstep.py``: two ranks sum in
another order than one process, and its margins, unlike a random model's, keep the greedy ids
the same: over this prompt's 40 greedy ids the smallest top-2 gap is 0.10, and plain decoding
over two ranks moves the logits by 8e-3 at most). Its config has no draft stages, so every
rank is given its part of the same seeded stages (split as the layers are: attention heads,
routed experts), with the Markov head planted
(:func:`_plant_bigrams`) to propose what the target said next after the same token: a drafter
whose blocks are accepted in part.
"""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from model.distributed import run_ranks
from model.engine import Engine, Sampling
from model.linear import World

DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"
CHUNK, GREEDY, SAMPLED = 16, 40, 16
PROMPT = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(4))


def _script(engine: Engine, prompt: torch.Tensor) -> tuple[dict, list]:
    """What a session does with speculation: a greedy reply and a seeded sampled one from one
    speculator, then with another a greedy reply whose reader stops inside a verified block,
    and a plain continuation of it. Returns the ids and counters, and the states made."""
    from model.dspark import speculator_for

    states = []

    def prefilled():
        states.append(engine.new_state())
        engine.prefill(states[-1], prompt)
        return states[-1]

    spec = speculator_for(engine.model, engine)
    out = {"greedy": list(spec.generate(prefilled(), Sampling(max_new_tokens=GREEDY), prompt[0]))}
    out["greedy_stats"] = vars(spec.stats).copy()
    params = Sampling(temperature=0.9, seed=5, max_new_tokens=SAMPLED)
    out["sampled"] = list(spec.generate(prefilled(), params, prompt[0]))
    out["stats"] = vars(spec.stats).copy()
    out["closed"], out["mid_block"] = _stop_mid_block(speculator_for(engine.model, engine), prefilled(), prompt)
    state = states[-1]
    engine.decode(state, torch.tensor([out["closed"][-1]]))  # as the agent feeds the last id read
    out["continued"] = list(engine.generate(state, Sampling(max_new_tokens=6)))
    return out, states


def _stop_mid_block(spec, state, prompt: torch.Tensor) -> tuple[list[int], bool]:
    """Read a greedy reply, 8 ids at least, until the round in progress has ids not yet read (a
    block with an accepted proposal), then close the stream: (the ids read, whether it stopped so)."""
    stream = spec.generate(state, Sampling(max_new_tokens=SAMPLED), prompt[0])
    got = []
    for token in stream:
        got.append(token)
        if len(got) >= 8 and spec.stats.emitted > len(got) - 1:  # the first id is sampled before any round
            break
    stream.close()
    return got, len(got) < SAMPLED


def _rank_model(world: World, said: list[int]):
    """This rank's part of the default model, with its part of seeded draft stages planted
    with the bigrams of ``said``."""
    from model.loading import build, load

    model = load(DEFAULT, world=world)
    args = model.args.replace(num_nextn_predict_layers=3)  # the backbone's config, with drafts
    model.mtp, model.args = build(args, seed=1, world=world).mtp.eval(), args
    assert len(model.mtp[0].ffn.experts) == args.dspark_n_routed_experts // world.size
    _plant_bigrams(model.mtp[-1], said)
    return model


def _plant_bigrams(last, said: list[int]) -> None:
    """The last stage's Markov head set to outweigh the rest of a proposal's logits with the
    token that followed the previous one first in ``said`` (one rank of the head per token
    seen), and a confidence of 1/2 everywhere (three proposals a block, ``choose_gamma``)."""
    follows = {}
    for prev, token in zip(said, said[1:]):
        follows.setdefault(prev, token)
    markov = last.markov_head
    with torch.no_grad():
        markov.embed.weight.zero_()
        markov.head.weight.zero_()
        last.confidence_head.proj.weight.zero_()
        for i, (prev, token) in enumerate(list(follows.items())[: markov.embed.weight.shape[1]]):
            markov.embed.weight[prev, i], markov.head.weight[token, i] = 1.0, 100.0


class _Keeping(Engine):
    """Test double of a follower's engine: keeps the cache of each state it makes and a weak
    reference to the state, and at each new state notes which earlier states are still held."""

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.made, self.held = [], []

    def new_state(self, *args, **kwargs):
        self.held = [ref() is not None for ref, _ in self.made]
        state = super().new_state(*args, **kwargs)
        self.made.append((weakref.ref(state), state.cache))
        return state


def _rank(world: World, said: list[int], results) -> None:
    from model.lockstep import Leader, _LeadSpeculator, follow

    torch.set_num_threads(1)
    model = _rank_model(world, said)
    if world.rank > 0:
        engine = _Keeping(model, chunk=CHUNK)
        follow(engine, world)
        results[world.rank] = {"caches": [c.state() for _, c in engine.made], "held": engine.held}
        return
    leader = Leader(model, world, chunk=CHUNK)
    out, states = _script(leader, PROMPT)
    out["caches"] = [s.cache.state() for s in states]
    out["refused"] = _refused_here(leader, PROMPT)
    spec = leader.speculator()
    out["lead"] = type(spec) is _LeadSpeculator
    dropped = {states[0].rank_handle, spec.rank_handle}
    del states[0], spec
    gc.collect()
    out["dropped"] = dropped <= set(leader._dropped)  # sent with the next call
    leader.new_state()
    leader.close()
    results[0] = out


def _refused_here(leader, prompt: torch.Tensor) -> bool:
    """A history too short for the draft context raises ValueError on rank 0 before any rank
    is sent the sync; the full history then syncs on every rank."""
    from model.dspark import speculator_for

    spec, state = speculator_for(leader.model, leader), leader.new_state()
    leader.prefill(state, prompt)
    try:
        spec.sync(state, prompt[0, -3:])
    except ValueError:
        spec.sync(state, prompt[0])
        return spec.context.length == state.length
    return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process's script and plain greedy ids, rank 0's and rank 1's results over two ranks)."""
    from model.loading import load

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(load(DEFAULT), chunk=CHUNK)
        state = engine.new_state()
        engine.prefill(state, PROMPT)
        plain = list(engine.generate(state, Sampling(max_new_tokens=GREEDY)))
        one, _ = _script(Engine(_rank_model(World(), plain), chunk=CHUNK), PROMPT)
    finally:
        torch.set_num_threads(before)
    with mp.Manager() as manager:
        results = manager.dict()
        rendezvous = tmp_path_factory.mktemp("ranks") / "rendezvous"
        run_ranks(_rank, 2, plain, results, init_method=f"file://{rendezvous}", timeout_s=300)
        got = dict(results)
    return one, plain, got[0], got[1]


def test_greedy_speculation_over_two_ranks_gives_one_process_ids(runs):
    one, plain, lead, _ = runs
    assert lead["lead"]  # the engine over ranks made the speculator that speculator_for gave
    assert lead["greedy"] == one["greedy"] == plain and len(plain) == GREEDY
    assert lead["greedy_stats"] == one["greedy_stats"]  # the same blocks drafted and verified
    stats = one["greedy_stats"]
    assert 0 < stats["accepted"] < stats["drafted"] and stats["forwards"] < GREEDY - 1


def test_seeded_sampling_over_two_ranks_gives_one_process_ids(runs):
    one, _, lead, _ = runs
    assert lead["sampled"] == one["sampled"] and len(one["sampled"]) == SAMPLED
    assert lead["stats"] == one["stats"]
    sampled = {k: one["stats"][k] - one["greedy_stats"][k] for k in one["stats"]}
    assert 0 < sampled["accepted"] < sampled["drafted"]  # proposals accepted and rejected


def test_a_stream_closed_mid_block_leaves_every_rank_as_one_process(runs):
    one, _, lead, follower = runs
    assert one["mid_block"] and lead["closed"] == one["closed"]
    assert lead["continued"] == one["continued"]
    _same_state(lead["caches"][-1], follower["caches"][len(lead["caches"]) - 1])


def test_the_follower_holds_rank_0s_caches(runs):
    _, _, lead, follower = runs
    assert len(follower["caches"]) == len(lead["caches"]) + 2  # and the two states made after the script
    for mine, theirs in zip(lead["caches"], follower["caches"]):
        _same_state(mine, theirs)


def test_a_history_too_short_is_refused_on_rank_0_alone(runs):
    assert runs[2]["refused"]


def test_what_rank_0_lets_go_of_the_follower_lets_go_of(runs):
    _, _, lead, follower = runs
    assert lead["dropped"]
    assert follower["held"] == [False, True, True, False]  # deleted; still held; let go of with its function


def _same_state(a, b) -> None:
    """Two ``Cache.state()``s equal: every buffer byte for byte (stale ring slots too) and the meta."""
    (ta, ma), (tb, mb) = a, b
    assert ma == mb and ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
