"""The model over a world of two gloo processes on the CPU (attention heads, vocabulary and
routed experts split, ``model.linear.World``) against one process: the same logits to float rounding on a
float KV cache (with the FP8 / FP4 cache a sum in another order can flip a rounding, and
the logits then move by more), the same 32 greedy tokens on the packed cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.args import ModelArgs
from model.linear import World
from model.quant import KVFormat



DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"  # trained: margins, not near-ties
ARGS = ModelArgs.from_file(DEFAULT)


def _whole():
    from model.loading import load

    return load(DEFAULT)


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    from model.engine import Engine

    engine = Engine(model, mode="ced", chunk=64)
    state = engine.new_state()
    tokens = []
    with torch.no_grad():
        engine.prefill(state, ids)
        for _ in range(n):
            token = state.last_logits.argmax(-1)
            tokens.append(int(token[0]))
            engine.decode(state, token)
    return tokens


def _rank(rank: int, size: int, init: str, ids: torch.Tensor, results) -> None:
    from model.loading import bind_tokenizer, local_state
    from model.model import Transformer
    from model.moe import stack_experts

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        world = World(rank=rank, size=size)
        with torch.device("meta"):
            model = Transformer(ARGS, world)
        model.load_state_dict(local_state(model, _whole().state_dict()), assign=True)
        model.ropes.make_on("cpu")
        stack_experts(model.eval())
        bind_tokenizer(model, DEFAULT / "tokenizer" / "tokenizer.json")
        assert model.layers[0].attn.n_heads == ARGS.num_attention_heads // size
        assert len(model.layers[0].ffn.experts) == ARGS.n_routed_experts // size
        with torch.no_grad():
            full = model(ids, model.new_cache(1, kv=KVFormat.FLOAT))
        results[rank] = (full, _greedy(model, ids, 32))
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_one_process_logits_and_tokens(tmp_path):
    ids = torch.randint(3, ARGS.vocab_size, (1, 150), generator=torch.Generator().manual_seed(5))
    model = _whole()
    with torch.no_grad():
        want_full = model(ids, model.new_cache(1, kv=KVFormat.FLOAT))
    want_tokens = _greedy(model, ids, 32)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", ids, results), nprocs=2, join=True)
        got = dict(results)
    for rank in (0, 1):
        full, tokens = got[rank]
        torch.testing.assert_close(full, want_full, rtol=1e-4, atol=1e-4)
        assert tokens == want_tokens


def test_a_split_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="vocab_size: 1024 do not split evenly over 3 ranks"):
        with torch.device("meta"):
            from model.model import Transformer

            Transformer(ModelArgs.preset("tiny"), World(rank=0, size=3))
