"""The Engram gate kernel (``model.kernels.engram``) against its twin ``engram_gate_ref``,
which is ``model.model.Engram``'s own code: to fp32 rounding (the channel sums in another
order), and exactly where a token is not live. Kernel tests run on CUDA, or under
``TRITON_INTERPRET=1``, else skip; the twin tests always run.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import engram_gate, engram_gate_ref, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def _inputs(lead, hc, D, dtype, live=False, seed=0):
    """Streams, and key / value as the two parts of one projection (strided rows), as the model has them."""
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(*lead, hc, D, generator=g) * 2).to(dtype)
    kv = (torch.randn(*lead, (hc + 1) * D, generator=g)).to(dtype)
    key, value = kv.split([hc * D, D], dim=-1)
    qw, kw = (1 + 0.2 * torch.randn(2, hc, D, generator=g)).to(dtype)
    mask = torch.rand(*lead, generator=g) > 0.4 if live else None
    return [None if t is None else t.to(DEVICE) for t in (streams, key, value, qw, kw, mask)]


def test_twin_gates_into_the_streams() -> None:
    """Each stream moves by a gate in (0, 1) times the value; not at all where not live."""
    streams, key, value, qw, kw, live = _inputs((2, 5), 4, 64, torch.float32, live=True)
    out = engram_gate_ref(streams, key, value, qw, kw, live, 1e-6)
    gate = (out - streams) / value.unsqueeze(-2)
    assert torch.equal(out[~live], streams[~live])
    assert gate[live].min() > 0 and gate[live].max() < 1
    torch.testing.assert_close(gate[live], gate[live][..., :1].expand_as(gate[live]), atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("lead,hc,D", [((1, 1), 4, 2048), ((3, 2), 4, 100), ((2, 1), 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("live", [False, True])
def test_kernel_matches_the_twin(lead, hc, D, dtype, live) -> None:
    from model.kernels import engram as kernel

    streams, key, value, qw, kw, mask = _inputs(lead, hc, D, dtype, live, seed=D + live)
    got, want = kernel.engram_gate(streams, key, value, qw, kw, mask, 1e-6), engram_gate_ref(
        streams, key, value, qw, kw, mask, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    if mask is not None:
        assert torch.equal(got[~mask], streams[~mask])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # a few fp32 ulps in the gate can round a bf16 the other way: one bf16 ulp, rarely
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
        assert (got != want).float().mean() < 0.01


@needs_kernel
def test_dispatcher_takes_the_kernel_outside_autograd_only(monkeypatch) -> None:
    from model.kernels import engram as kernel

    calls = []
    real = kernel.engram_gate
    monkeypatch.setattr(kernel, "engram_gate", lambda *a: calls.append(1) or real(*a))
    streams, key, value, qw, kw, _ = _inputs((1, 3), 4, 64, torch.float32)
    engram_gate(streams, key, value, qw, kw, None, 1e-6)
    assert calls == [1]
    out = engram_gate(streams, key, value, qw.clone().requires_grad_(), kw, None, 1e-6)
    assert calls == [1] and out.requires_grad


def _hash_inputs(B, S, heads, seed=0):
    """An Engram hasher's tables (``small``'s 2 layers of 2- to 4-grams, ``heads`` primes
    each) and compressed ids with image tokens (DEAD) in the chunk and the history."""
    from model.engram import DEAD, NgramHasher

    hasher = NgramHasher(list(range(700)), (1, 14), 1000, heads, 4, pad_id=3)
    g = torch.Generator().manual_seed(seed)
    compressed = torch.randint(0, 660, (B, S), generator=g)
    compressed[torch.rand(B, S, generator=g) < 0.15] = DEAD
    history = torch.randint(0, 660, (B, 3), generator=g)
    history[torch.rand(B, 3, generator=g) < 0.3] = DEAD
    _, multipliers, primes, offsets = hasher.tables(DEVICE)
    return [t.to(DEVICE) for t in (compressed, history)] + [multipliers, primes, offsets, hasher.pad, DEAD]


def test_hash_twin_is_the_xor_of_the_lookback_modulo_each_prime() -> None:
    """ngram_hash_ref against the definition written out with Python integers: for each
    token, layer, n-gram length and head, the XOR of (token back t, or the pad at and past a
    DEAD one) times the layer's multiplier t, modulo the head's prime, plus its offset."""
    from model.kernels import ngram_hash_ref

    compressed, history, mult, primes, offsets, pad, dead = _hash_inputs(2, 9, 3, seed=1)
    got = ngram_hash_ref(compressed, history, mult, primes, offsets, pad, dead)
    seq = torch.cat([history, compressed], 1).tolist()
    L, n = mult.shape
    for b in range(2):
        for s in range(9):
            back, blocked = [], False
            for t in range(n):
                tok = seq[b][3 + s - t]
                blocked = blocked or tok == dead
                back.append(pad if blocked else tok)
            for layer in range(L):
                rolling = 0
                for t in range(n):
                    rolling ^= back[t] * int(mult[layer, t])
                    if t:
                        for j in range(3):
                            col = (t - 1) * 3 + j
                            want = rolling % int(primes[layer, t - 1, j]) + int(offsets[layer, col])
                            assert int(got[b, s, layer, col]) == want, (b, s, layer, t, j)


@needs_kernel
@pytest.mark.parametrize("B,S,heads", [(1, 1, 8), (4, 1, 8), (2, 37, 2), (1, 5, 3)])
def test_hash_kernel_equals_the_twin(B, S, heads) -> None:
    from model.kernels import engram as kernel
    from model.kernels import ngram_hash_ref

    inputs = _hash_inputs(B, S, heads, seed=B * 100 + S)
    got, want = kernel.ngram_hash(*inputs), ngram_hash_ref(*inputs)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("B", [1, 3])
def test_step_kernel_does_what_the_steps_parts_do(B) -> None:
    """``engram_step`` (one launch: compress, look-back from the ring, hash, the ring's write)
    against the parts a step runs without it (``NgramHasher.compress``, ``Cache.engram_history``,
    ``ngram_hash_ref``, ``Cache.record_engram``), from rings that hold DEAD ids, stale slots
    (positions of another lap) and nothing yet, at positions 0 to past the ring's length:
    the same row ids and the same ring after, in every step of a run."""
    from model.args import ModelArgs
    from model.cache import Cache
    from model.engram import DEAD, NgramHasher
    from model.kernels import engram as kernel
    from model.kernels import ngram_hash_ref

    args = ModelArgs.preset("tiny")
    hasher = NgramHasher(list(range(1000)), (1, 4), 1000, 2, 4, pad_id=3)
    token_map, multipliers, primes, offsets = hasher.tables(DEVICE)
    mine, theirs = Cache(args, batch=B, device=DEVICE), Cache(args, batch=B, device=DEVICE)
    HR = mine.engram_pos.shape[0]
    g = torch.Generator().manual_seed(B)
    for start in list(range(0, 6)) + list(range(HR - 3, HR + 4)) + [2 * HR + 1]:
        if start == HR - 3:  # a DEAD id (an image token) and a slot of another lap in the look-back
            for cache in (mine, theirs):
                cache.engram_ids[:, (start - 1) % HR] = DEAD
                cache.engram_pos[(start - 2) % HR] = start - 2 - HR
        ids = torch.randint(0, 1000, (B, 1), generator=g).to(DEVICE)
        got = kernel.engram_step(ids, token_map, mine.engram_ids, mine.engram_pos, start, multipliers, primes,
                                 offsets, hasher.pad, DEAD)
        compressed = hasher.compress(ids, None)
        want = ngram_hash_ref(compressed, theirs.engram_history(start, 3), multipliers, primes, offsets, hasher.pad,
                              DEAD)
        theirs.record_engram(compressed, start)
        assert torch.equal(got, want), start
        assert torch.equal(mine.engram_ids, theirs.engram_ids) and torch.equal(mine.engram_pos, theirs.engram_pos)


@needs_kernel
def test_a_decode_step_hashes_with_the_step_kernel(monkeypatch) -> None:
    """A decode step's hashing (``decode_step._hash_step``) on one new token a row takes the
    one launch; its rows and the ring it leaves are those of ``Transformer.engram_hash``'s parts."""
    import copy

    from model import decode_step, kernels
    from model.args import ModelArgs
    from model.cache import Cache
    from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

    model = build(ModelArgs.preset("tiny"), seed=0, device=DEVICE)
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    g = torch.Generator().manual_seed(4)
    mine = Cache(model.args, batch=2, device=DEVICE)
    model.engram_hash(torch.randint(3, 1000, (2, 7), generator=g).to(DEVICE), mine, 0)  # a prompt: the parts
    theirs = copy.deepcopy(mine)
    launched, step = [], kernels.engram_step

    def counted(*a):
        out = step(*a)
        launched.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "engram_step", counted)
    for start in range(7, 12):
        ids = torch.randint(3, 1000, (2, 1), generator=g).to(DEVICE)
        got = decode_step._hash_step(model, ids, mine, start)
        want = model.engram_hash(ids, theirs, start)  # the reference: the parts
        assert torch.equal(got, want)
        assert torch.equal(mine.engram_ids, theirs.engram_ids) and torch.equal(mine.engram_pos, theirs.engram_pos)
    assert launched == [True] * 5  # the kernel ran each step
