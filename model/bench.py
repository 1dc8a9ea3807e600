"""Engine benchmarks: every figure a ratio measured side by side in one run (RUNTIME.md §9).

Owns the measurements behind ``dsagent bench load|prefill|decode|resume|linears``: a load's
time and memory (the bytes held, the host's resident memory before, at the peak and after, the
device's on CUDA), CED vs exact prefill (tokens/s and output agreement), decode step time at
two context lengths, resume from exported bytes vs a full re-prefill, DSpark speculative
decoding (verify-block cost vs one decode step, accepted length, tokens per target forward),
and the prefill linear layers against the device's dense matmul rate. Returns plain dicts;
printing is the CLI's job. Not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import copy
import os
import re
import statistics
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from model import decode_step
from model.census import decode_read_bytes, prefill_flops
from model.engine import Engine, Sampling, State, default_chunk
from model.model import Transformer
from model.moe import GroupedLinear


def engine_for(model: Transformer, **options) -> Engine:
    """The engine a benchmark drives: over several ranks rank 0's ``model.lockstep.Leader``
    (the others follow it: ``dsagent bench ... --gpus N``), else a plain ``Engine``."""
    if model.world.size > 1:
        from model.lockstep import Leader

        return Leader(model, model.world, **options)
    return Engine(model, **options)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def bench_model(preset: str, *, device="cuda", dtype: torch.dtype = torch.bfloat16, weights: str = "plain",
                layers: int | None = None, engram_rows: int | None = None) -> tuple[Transformer, dict]:
    """A preset for benchmarks (seeded weights), cut to ``layers`` / ``engram_rows``
    (``ModelArgs.shortened``), ``weights`` plain or packed, and what loading it took
    (:func:`measured_load`'s figures), built as ``model.loading.load`` builds a preset (a
    stand-in Engram token map where the bundled tokenizer has fewer ids: ``v41-flash``)."""
    from model.args import ModelArgs
    from model.loading import load

    args = ModelArgs.preset(preset, layers=layers, engram_rows=engram_rows)
    model, out = measured_load(lambda progress: load(preset, device=device, dtype=dtype, weights=weights, args=args),
                               device)
    return model, {"bench": "load", "preset": preset, "layers": args.num_hidden_layers, "weights": weights,
                   "engram_rows": list(args.engram_num_embeddings), **out, **load_ratios(out, device)}


def bench_checkpoint(path: str | Path, *, device="cpu", dtype: torch.dtype = torch.float32, weights: str = "plain",
                     progress=None) -> tuple[Transformer, dict]:
    """A checkpoint directory loaded as ``dsagent run`` loads it (``model.loading.load``: the
    shards memory-mapped, read tensor by tensor), ``progress(done, total)`` called after each
    tensor, and what it took (:func:`measured_load`) beside the checkpoint's shard files:
    their bytes on disk and the largest one's."""
    from model.loading import load

    files = shard_files(path)
    model, out = measured_load(lambda tick: load(path, device=device, dtype=dtype, weights=weights,
                                                 progress=_both(tick, progress)), device)
    out = {"bench": "load", "checkpoint": str(path), "weights": weights, "layers": model.args.num_hidden_layers,
           **out, "shards": len(files), "checkpoint_bytes": sum(f.stat().st_size for f in files),
           "largest_shard_bytes": max(f.stat().st_size for f in files)}
    return model, {**out, **load_ratios(out, device)}


def _both(first, second):
    """A progress callback calling ``first``, then ``second`` when there is one."""
    if second is None:
        return first
    return lambda done, total: (first(done, total), second(done, total))


def shard_files(path: str | Path) -> list[Path]:
    """A checkpoint's safetensors files: those its index names, else its one ``model.safetensors``."""
    from model.checkpoint import INDEX_FILE, read_weight_map

    root = Path(path)
    if (root / INDEX_FILE).is_file():
        return [root / f for f in sorted(set(read_weight_map(root).values()))]
    return [root / "model.safetensors"]


def measured_load(load, device) -> tuple[Transformer, dict]:
    """``load(progress)``'s model and what making it took: seconds, the bytes its tensors hold
    (its state dict's), the host's memory over it (:class:`HostMemory`, sampled at each
    ``progress`` call too) and on CUDA the memory allocated after it and at its peak."""
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with HostMemory() as host:
        start = time.perf_counter()
        model = load(lambda done, total: host.sample())
        _sync(device)
        seconds = time.perf_counter() - start
    out = {"device": str(device), "load_s": seconds,
           "held_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()), **host.figures}
    if cuda:
        out.update(gpu_allocated_bytes=torch.cuda.memory_allocated(), gpu_peak_bytes=torch.cuda.max_memory_allocated())
        out["allocated_over_held"] = out["gpu_allocated_bytes"] / out["held_bytes"]
    return model, out


def load_ratios(out: dict, device) -> dict:
    """The ratios of a load's figures, those its figures allow:

    - ``held_over_checkpoint``: the bytes the model's tensors hold over the checkpoint's shard
      files (packed weights: about 1, the files being those bytes and their headers; plain: the
      FP8 / FP4 families widened to the model's dtype).
    - ``gpu_allocated_over_checkpoint`` (CUDA): the device's allocated bytes after the load over
      the shard files; with packed weights the target is 1.05 at most.
    - ``host_growth_bytes``: what the load added to the host's resident set at its peak,
      ``rss_peak_bytes - rss_before_bytes`` (file-backed pages of mapped shards included, so an
      upper bound on what it needed). None where the peak is not the load's own.
    - ``growth_over_shard`` (CUDA, a checkpoint): that growth over the largest shard: the
      weights go to the device, so a load that copies tensor by tensor needs the host for
      about one shard (its mapped pages) at most: about 1 or less.
    - ``growth_over_held_and_shard`` (CPU): that growth over the held bytes plus the
      largest shard (0 for a preset): on the CPU the weights themselves are host memory, so a
      load adds them and about one shard more at most: about 1 or less.
    """
    shard, growth = out.get("largest_shard_bytes", 0), None
    if out.get("rss_peak_bytes") is not None and out.get("rss_before_bytes") is not None:
        growth = out["rss_peak_bytes"] - out["rss_before_bytes"]
    ratios = {"host_growth_bytes": growth}
    if "checkpoint_bytes" in out:
        ratios["held_over_checkpoint"] = out["held_bytes"] / out["checkpoint_bytes"]
    if "gpu_allocated_bytes" in out and "checkpoint_bytes" in out:
        ratios["gpu_allocated_over_checkpoint"] = out["gpu_allocated_bytes"] / out["checkpoint_bytes"]
    if str(device).startswith("cuda") and shard:
        ratios["growth_over_shard"] = None if growth is None else growth / shard
    elif str(device) == "cpu":
        ratios["growth_over_held_and_shard"] = None if growth is None else growth / (out["held_bytes"] + shard)
    return ratios


_STATUS = ("VmRSS", "VmHWM", "RssAnon")


def proc_memory() -> dict[str, int]:
    """This process's VmRSS, VmHWM and RssAnon from ``/proc/self/status``, in bytes; empty
    where there is none (not Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.splitlines())
    return {key: int(value.split()[0]) * 1024 for key, _, value in fields if key in _STATUS}


def _reset_peak_rss() -> bool:
    """Set the kernel's high-water mark (VmHWM) back to the present resident set (Linux 4.0+:
    ``5`` written to ``/proc/self/clear_refs``); whether it was."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class HostMemory:
    """The process's host memory over a block (``with HostMemory() as m: ...``; ``m.figures``).

    The resident set counts anonymous pages (RssAnon: allocations, no file behind them) and
    file-backed ones (RssFile: among them a memory-mapped shard's pages as they are read, which
    the OS may drop and read again); neither measure below alone is the block's exact need:

    - ``rss_before_bytes`` / ``rss_after_bytes``: the resident set (VmRSS) at the block's ends.
    - ``rss_peak_bytes``: its highest during the block: the kernel's high-water mark (VmHWM),
      set back to the present resident set as the block starts, so every page counts, but
      dropped file pages count too: an upper bound. None where the mark cannot be set back
      (it would be the process's peak since it started, not the block's).
    - ``anon_before_bytes`` / ``anon_peak_bytes`` / ``anon_after_bytes``: the anonymous part
      (RssAnon), its peak sampled every ``interval`` seconds on a thread and at each
      :meth:`sample` call (a load's progress callback: after each tensor): a peak between two
      samples is missed, so a lower bound on the anonymous peak.

    Every figure is None where there is no ``/proc`` (not Linux)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.figures = interval, {}
        self._peak, self._lock, self._stop = 0, threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def sample(self) -> None:
        anon = proc_memory().get("RssAnon", 0)
        with self._lock:
            self._peak = max(self._peak, anon)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "HostMemory":
        self._reset = _reset_peak_rss()
        self._before = proc_memory()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        before, after = self._before, proc_memory()
        self.figures = {"rss_before_bytes": before.get("VmRSS"), "rss_peak_bytes": after.get("VmHWM") if self._reset
                        else None, "rss_after_bytes": after.get("VmRSS"), "anon_before_bytes": before.get("RssAnon"),
                        "anon_peak_bytes": self._peak or None, "anon_after_bytes": after.get("RssAnon")}


def prompt_ids(model: Transformer, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.args.vocab_size, (1, n), generator=g).to(model.device)


def greedy(engine: Engine, state: State, n: int) -> list[int]:
    return list(engine.generate(state, Sampling(max_new_tokens=n)))


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions before the first disagreement (prefix agreement)."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, min(len(a), len(b)))


def bench_prefill(model: Transformer, ctx: int, *, chunk: int | None = None, gen: int = 64, parts: bool = True,
                  matmul_size: int | None = None) -> dict:
    """Exact and CED prefill of ``ctx`` random tokens: tokens/s, how far their outputs agree,
    and the model FLOPs each executes (``model.census.prefill_flops``) over its time against
    the device's dense matmul rate measured in the same run (``prefill_mfu``: bf16 n = 8192 on
    CUDA, the model's dtype n = 2048 on the CPU). ``parts``: a second run of each mode with
    every part of the model timed apart (:class:`_PartTimer`), by part: FLOPs, seconds, share
    of the run, TFLOP/s and that over the matmul rate (the hooks' own cost is in that run's
    total, not in the tokens/s)."""
    device = model.device
    peak = _matmul_rate(model, matmul_size)[2]
    ids = prompt_ids(model, ctx)
    chunk = chunk or default_chunk(device)
    runs, out = {}, {"bench": "prefill", "ctx": ctx, "chunk": chunk, "device": str(device), "matmul_tflops": peak}
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for mode in ("exact", "ced"):
        engine = engine_for(model, mode=mode, chunk=chunk)
        if device.type == "cuda":  # warm-up: the allocator's blocks, the GEMM handles, the kernels' builds
            engine.prefill(engine.new_state(), ids[:, :min(ctx, 2 * chunk)])
        state = engine.new_state()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        logits, secs = _timed(lambda: engine.prefill(state, ids), device)
        if device.type == "cuda":  # what the prefill needed on top of the weights, its cache included
            out[f"{mode}_peak_gb_over_weights"] = (torch.cuda.max_memory_allocated(device) - weights) / 1e9
        flops = prefill_flops(model.args, ctx, mode)
        runs[mode] = {"seconds": secs, "logits": logits.float(), "greedy": greedy(engine, state, gen)}
        out[f"{mode}_tokens_per_s"] = ctx / secs
        out[f"{mode}_gflop_per_token"] = flops["total"] / ctx / 1e9
        out[f"{mode}_prefill_mfu"] = flops["total"] / secs / 1e12 / peak
        if parts:
            out[f"{mode}_by_part"] = _prefill_parts(model, engine, ids, flops["by_part"], peak)
    diff = (runs["ced"]["logits"] - runs["exact"]["logits"]).abs().max().item()
    out.update(ced_speedup=runs["exact"]["seconds"] / runs["ced"]["seconds"], first_token_max_logit_diff=diff,
               greedy_agreement=agreement(runs["ced"]["greedy"], runs["exact"]["greedy"]), greedy_tokens=gen)
    return out


def _matmul_rate(model: Transformer, size: int | None = None, repeats: int = 5) -> tuple[int, torch.dtype, float]:
    """The dense matmul rate the FLOP figures are measured against: (n, dtype, TFLOP/s) of an
    n×n×n product, bf16 and n = 8192 on CUDA, the model's dtype and n = 2048 on the CPU."""
    cuda = model.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else model.embed.weight.dtype
    size = size or (8192 if cuda else 2048)
    return size, dtype, matmul_tflops(size, dtype, model.device, repeats)


def _prefill_parts(model: Transformer, engine: Engine, ids: torch.Tensor, flops: dict, peak: float) -> dict:
    """One more prefill of ``ids`` with :class:`_PartTimer`'s hooks: each part's time (its
    modules' own, their children's taken out), beside its FLOPs (``flops``, the census's)."""
    timer = _PartTimer(model, _Clock(model.device))
    try:
        _, total = _timed(lambda: engine.prefill(engine.new_state(), ids), model.device)
    finally:
        timer.close()
    seconds = timer.seconds()
    seconds["other"] = max(0.0, total - sum(seconds.values()))
    out = {}
    for part in sorted(set(seconds) | set(flops), key=lambda p: -seconds.get(p, 0.0)):
        f, t = flops.get(part, 0), seconds.get(part, 0.0)
        out[part] = {"flops": f, "seconds": t, "share": t / total,
                     "tflops": f / t / 1e12 if t else 0.0, "over_matmul": f / t / 1e12 / peak if t else 0.0}
    return out


def bench_decode(model: Transformer, ctx: int, *, short: int | None = None, steps: int = 16, chunk: int = 512) -> dict:
    """Step time at two context lengths, and at the long one the bytes a step must read
    (``model.census.decode_read_bytes``) per second against the device's copy bandwidth
    measured in the same run (bytes read + written, as copy benchmarks count)."""
    short = short or max(model.args.sliding_window, ctx // 32)
    times = {n: _step_seconds(model, n, 1, steps, chunk) for n in (short, ctx)}
    read = decode_read_bytes(model.args, ctx, weight_bytes=model.embed.weight.element_size())
    held = weights_read_bytes(model)  # the bytes the weights are held in, packed or not
    read["total"], read["weights"] = read["total"] - read["weights"] + held, held
    copy = copy_tb_per_s(model.device)
    achieved = read["total"] / times[ctx] / 1e12
    out = {"bench": "decode", "ctx_short": short, "ctx_long": ctx, "step_ms_short": 1e3 * times[short],
           "step_ms_long": 1e3 * times[ctx], "long_over_short": times[ctx] / times[short],
           "layer_ms_long": 1e3 * times[ctx] / model.args.num_hidden_layers,
           "decode_tokens_per_s_long": 1 / times[ctx], "read_bytes_long": read,
           "read_tb_per_s_long": achieved, "copy_tb_per_s": copy, "bandwidth_over_copy": achieved / copy}
    return out | (_collectives(model, times[ctx]) if model.world.size > 1 else {})


def weights_read_bytes(model: Transformer) -> int:
    """Bytes of weights a batch-1 decode step reads, as the model holds them (packed: the
    stored bytes and scales): every parameter of the layers and the head, a routed expert's
    top-k share of its layer's experts, one row of the embedding and ``n_cols`` rows of each
    Engram table; nothing of the vision tower or the draft stages."""
    a, total = model.args, 0
    tables = {id(b.engram.embed) for b in model.layers if b.engram is not None}
    for name, module in model.named_modules():
        held = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if not held or name.startswith(("vision", "aligner", "mtp")):
            continue
        if ".ffn.experts." in name:
            total += held * a.num_experts_per_tok // a.n_routed_experts  # the top-k of the layer's experts
        elif id(module) in tables:
            total += held * a.engram_n_cols // module.full_rows
        elif name == "embed":
            total += held // a.vocab_size
        else:
            total += held
    return total


def bench_engram(model: Transformer, ctx: int, *, steps: int = 16, chunk: int = 512, repeats: int = 50) -> dict:
    """The Engram tables on the device against in host memory (``Table.host``), side by side
    in one run on the same weights: a decode step's time after a CED prefill of ``ctx`` tokens
    with each placement, and each placement's gather of one step's rows of every table (the
    host's: the ids read back, the rows gathered, copied from pinned memory and dequantised
    on the device), timed alone."""
    held = [b.engram.embed for b in model.layers if b.engram is not None]
    if not held or model.world.size > 1:
        return {}
    a = model.args
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, t.full_rows, (1, 1, a.engram_n_cols), generator=g).to(model.device) for t in held]
    out = {"bench": "engram", "ctx": ctx, "tables": len(held),
           "table_bytes": sum(p.numel() * p.element_size() for t in held for p in t.parameters())}
    for place in ("device", "host"):
        with _tables_in(model, held, place):
            out[f"step_ms_{place}"] = 1e3 * _step_seconds(model, ctx, 1, steps, chunk)
            gather = (lambda: [t.ready(t.fetch(i)) for t, i in zip(held, ids)]) if place == "host" else \
                (lambda: [t(i) for t, i in zip(held, ids)])
            gather()
            _, secs = _timed(lambda: [gather() for _ in range(repeats)], model.device)
            out[f"gather_us_{place}"] = 1e6 * secs / repeats
    out["gather_over_step_host"] = out["gather_us_host"] / 1e3 / out["step_ms_host"]
    out["step_host_over_device"] = out["step_ms_host"] / out["step_ms_device"]
    return out


@contextmanager
def _tables_in(model: Transformer, tables: list, place: str):
    """``tables`` kept in ``place`` (``device`` or ``host``) for the block, then where they were;
    the captured graphs, which hold their addresses, dropped at each move."""
    def move(t, host: bool):
        target = "cpu" if host else model.device
        for name, p in list(t._parameters.items()):
            t._parameters[name] = nn.Parameter(p.data.to(target), requires_grad=False)
        t.host = host
        model.derived.clear()

    was = [t.host for t in tables]
    for t in tables:
        move(t, place == "host")
    try:
        yield
    finally:
        for t, host in zip(tables, was):
            move(t, host)


def _collectives(model: Transformer, step_s: float) -> dict:
    """Over several ranks: the all-reduces a decode step of one row makes (the embedding's,
    per layer the attention's ``wo_b`` and the MoE's, and each Engram layer's whose table the
    ranks split by rows), each timed alone on a [1, 1, D] tensor of the model's dtype, beside
    the step; the logits' gather is not counted."""
    split_tables = sum(b.engram is not None and b.engram.embed.world.size > 1 for b in model.layers)
    count = 1 + 2 * model.args.num_hidden_layers + split_tables
    one = engine_for(model).all_reduce_seconds((1, 1, model.args.hidden_size), model.embed.weight.dtype)
    return {"ranks": model.world.size, "all_reduces_per_step": count, "all_reduce_us": 1e6 * one,
            "all_reduce_ms_per_step": 1e3 * count * one, "all_reduce_over_step": count * one / step_s}


def copy_tb_per_s(device, nbytes: int = 2 ** 28, repeats: int = 5) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    _, secs = _timed(lambda: [y.copy_(x) for _ in range(repeats)], device)
    return repeats * 2 * nbytes / secs / 1e12


# Decode steps before a timing starts: they build the kernels and capture the CUDA graphs,
# including the recapture that follows when a records buffer grows on the first records a
# step appends (a prompt that fills one exactly, e.g. 4,096 tokens at ratio 2; measured on
# the H200: 42.5 ms per step over 8 steps with 1 warm-up step at 4,096 tokens, 25.3 ms at 4,000).
WARMUP_STEPS = 4


def _warm_decoder(model: Transformer, ctx: int, batch: int, chunk: int):
    """A decode step of ``batch`` rows after a CED prefill of ``ctx`` tokens and WARMUP_STEPS
    steps, as a function of no arguments."""
    engine = engine_for(model, mode="ced", chunk=chunk)
    state = engine.new_state(batch=batch)
    engine.prefill(state, prompt_ids(model, ctx).expand(batch, -1))
    token = state.last_logits.argmax(-1)
    for _ in range(WARMUP_STEPS):
        engine.decode(state, token)
    return lambda: engine.decode(state, token)


def _step_seconds(model: Transformer, ctx: int, batch: int, steps: int, chunk: int) -> float:
    """Mean decode step time of ``batch`` rows after a CED prefill of ``ctx`` tokens."""
    step = _warm_decoder(model, ctx, batch, chunk)
    _, secs = _timed(lambda: [step() for _ in range(steps)], model.device)
    return secs / steps


def export_bytes(engine: Engine, state: State) -> tuple[bytes, dict]:
    tensors, meta = engine.export_global(state)
    return st_save(tensors), meta


def bench_resume(model: Transformer, ctx: int, *, chunk: int = 512, gen: int = 64,
                 replay_tokens: tuple = ()) -> dict:
    """Uninterrupted CED run vs export -> bytes -> import -> replay, and vs re-prefill."""
    ids = prompt_ids(model, ctx)
    engine = engine_for(model, mode="ced", chunk=chunk)
    state, prefill_s = _timed(lambda: _prefilled(engine, ids), model.device)
    blob, meta = export_bytes(engine, state)
    base_logits, base_greedy = state.last_logits.float(), greedy(engine, state, gen)
    out = {"bench": "resume", "ctx": ctx, "full_prefill_s": prefill_s, "state_bytes": len(blob),
           "state_bytes_per_token": len(blob) / ctx, "formula_bytes_per_token": model.args.kv_bytes_per_token(),
           "replays": []}
    out["state_over_formula"] = out["state_bytes_per_token"] / out["formula_bytes_per_token"]
    for r in replay_tokens or (model.args.sliding_window,):
        resumed, secs = _timed(lambda: _resume(engine, blob, meta, ids, r), model.device)
        out["replays"].append({"replay_tokens": r, "resume_s": secs, "resume_over_prefill": secs / prefill_s,
                               "first_token_max_logit_diff": (resumed.last_logits.float() - base_logits).abs().max().item(),
                               "greedy_agreement": agreement(greedy(engine, resumed, gen), base_greedy)})
    return out


def _prefilled(engine: Engine, ids: torch.Tensor) -> State:
    state = engine.new_state()
    engine.prefill(state, ids)
    return state


def _resume(engine: Engine, blob: bytes, meta: dict, ids: torch.Tensor, replay: int) -> State:
    state = engine.import_global(st_load(blob), meta)
    engine.replay(state, ids, tokens=replay)
    return state


def bench_speculative(model: Transformer, ctx: int, *, gen: int = 64, chunk: int = 512, repeats: int = 4,
                      params: Sampling | None = None) -> dict:
    """DSpark speculation from one CED-prefilled state: the cost of verifying a full block
    (anchor + ``dspark_block_size`` proposals) in one forward against one decode step, then
    ``gen`` tokens plain and speculative (greedy unless ``params``). The measured cost per
    extra verified token sets the speculator's γ rule. Raises SpeculationUnavailable
    when the model has no draft stages."""
    from model.dspark import Speculator

    ids, block = prompt_ids(model, ctx), model.args.dspark_block_size
    engine = engine_for(model, mode="ced", chunk=chunk)
    state = _prefilled(engine, ids)
    anchor = int(state.last_logits.argmax())
    step_s, verify_s = _verify_cost(model, state, [anchor] + ids[0, :block].tolist(), repeats)
    params = params or Sampling(max_new_tokens=gen)
    plain, plain_s = _timed(lambda: list(engine.generate(copy.deepcopy(state), params)), model.device)
    spec = Speculator(model, engine, extra_token_cost=max(0.0, verify_s / step_s - 1) / block)
    fast, spec_s = _timed(lambda: list(spec.generate(copy.deepcopy(state), params, ids[0])), model.device)
    s = spec.stats
    return {"bench": "speculative", "ctx": ctx, "block_size": block, "gen": len(fast),
            "decode_step_ms": 1e3 * step_s, "verify_block_ms": 1e3 * verify_s, "verify_over_decode": verify_s / step_s,
            "extra_token_cost": spec.extra_token_cost, "target_forwards": s.forwards,
            "mean_accepted": s.mean_accepted, "acceptance_rate": s.acceptance_rate,
            "tokens_per_forward": s.tokens_per_forward, "plain_tokens_per_s": len(plain) / plain_s,
            "spec_tokens_per_s": len(fast) / spec_s, "speedup": plain_s / spec_s * len(fast) / max(1, len(plain)),
            "greedy_agreement": agreement(fast, plain)}


def bench_speculative_replies(model: Transformer, prompts: list[tuple[torch.Tensor, object, int]], *,
                              stop_ids: tuple[int, ...] = (), chunk: int = 512, repeats: int = 4,
                              temperature: float = 0.0) -> dict:
    """DSpark on real replies: each prompt (ids [1, N], its image inputs or None, a token
    budget) CED-prefilled once, then its greedy reply plain and speculative from copies of
    that state, each timed (the copies made outside the clock). Beside tokens/s both ways:
    per verify forward the proposals accepted, the tokens emitted and the block length the
    confidence head chose; the cost of verifying a whole block against one decode step
    (the first prompt's state), which also sets the speculator's cost per extra token; and
    the replies that differ (greedy: a float rounding flip, batch-shape order of sums;
    ``temperature`` > 0: sampled, prompt i with seed i both ways, so replies differ by draw)."""
    from model.dspark import Speculator

    engine, block = engine_for(model, mode="ced", chunk=chunk), model.args.dspark_block_size
    cost, verify_over_decode = None, None
    plain_s = spec_s = 0.0
    plain_n = spec_n = differ = 0
    totals = {"forwards": 0, "drafted": 0, "accepted": 0, "emitted": 0}
    for i, (ids, images, budget) in enumerate(prompts):
        state = engine.new_state()
        engine.prefill(state, ids, images=images)
        if cost is None:
            anchor = int(state.last_logits.argmax())
            step_s, verify_s = _verify_cost(model, state, [anchor] + ids[0, -block:].tolist(), repeats)
            verify_over_decode = verify_s / step_s
            cost = max(0.0, verify_over_decode - 1) / block
        params = Sampling(temperature=temperature, seed=i, max_new_tokens=budget, stop_ids=stop_ids)
        one, two = copy.deepcopy(state), copy.deepcopy(state)
        plain, secs = _timed(lambda: list(engine.generate(one, params)), model.device)
        plain_s, plain_n = plain_s + secs, plain_n + len(plain)
        spec = Speculator(model, engine, extra_token_cost=cost)
        fast, secs = _timed(lambda: list(spec.generate(two, params, ids[0])), model.device)
        spec_s, spec_n, differ = spec_s + secs, spec_n + len(fast), differ + (fast != plain)
        for k in totals:
            totals[k] += getattr(spec.stats, k)
    n = max(1, totals["forwards"])
    plain_rate, spec_rate = plain_n / plain_s, spec_n / spec_s
    return {"bench": "speculative_replies", "replies": len(prompts), "temperature": temperature, "block_size": block,
            "plain_tokens": plain_n, "spec_tokens": spec_n, "replies_differing": differ,
            "verify_over_decode": verify_over_decode, "extra_token_cost": cost, "verify_forwards": totals["forwards"],
            "accepted_per_verify": totals["accepted"] / n, "tokens_per_verify": totals["emitted"] / n,
            "block_length": totals["drafted"] / n, "acceptance_rate": totals["accepted"] / max(1, totals["drafted"]),
            "plain_tokens_per_s": plain_rate, "spec_tokens_per_s": spec_rate, "speedup": spec_rate / plain_rate}


def _verify_cost(model: Transformer, state: State, block: list[int], repeats: int) -> tuple[float, float]:
    """(seconds of a decode step of ``block``'s anchor, seconds of a forward verifying ``block``)
    from ``state``."""
    return _forward_seconds(model, state, block[:1], repeats), _forward_seconds(model, state, block, repeats)


def _forward_seconds(model: Transformer, state: State, ids: list[int], repeats: int) -> float:
    """Mean seconds of one target forward over ``ids`` from ``state`` (rolled back each time,
    after one warm-up)."""
    n, x = state.length, torch.tensor([ids], device=model.device)
    total = 0.0
    for i in range(repeats + 1):
        with torch.no_grad():
            _, secs = _timed(lambda: decode_step.forward(model, x, state.cache), model.device)
        state.cache.truncate(n)
        total += secs if i else 0.0
    return total / repeats


def bench_batch(model: Transformer, ctx: int, *, batch: int = 16, steps: int = 8, chunk: int = 512) -> dict:
    """Decode tokens/s at ``batch`` rows against one row, same context length."""
    rates = {b: b / _step_seconds(model, ctx, b, steps, chunk) for b in (1, batch)}
    return {"bench": "batch", "ctx": ctx, "batch": batch, "tokens_per_s_batch1": rates[1],
            f"tokens_per_s_batch{batch}": rates[batch], "batch_speedup": rates[batch] / rates[1]}


PATH_SWITCHES = {"graphs": "DSAGENT_GRAPHS", "kernels": "DSAGENT_KERNELS", "fused_moe": "DSAGENT_FUSED_MOE",
                 "grouped_moe": "DSAGENT_GROUPED_MOE", "pdl": "DSAGENT_PDL", "mhc_overlap": "DSAGENT_MHC_OVERLAP",
                 "select": "DSAGENT_SELECT", "gemv": "DSAGENT_GEMV"}


@contextmanager
def switched(**paths: bool):
    """Fast paths on or off (``graphs=False`` sets ``DSAGENT_GRAPHS=0``) for the block; the
    environment as it was afterwards."""
    saved = {PATH_SWITCHES[name]: os.environ.get(PATH_SWITCHES[name]) for name in paths}
    try:
        for name, on in paths.items():
            os.environ[PATH_SWITCHES[name]] = "1" if on else "0"
        yield
    finally:
        for env, value in saved.items():
            os.environ.pop(env, None)
            if value is not None:
                os.environ[env] = value


def bench_paths(model: Transformer, ctx: int, *, batch: int = 1, steps: int = 8, chunk: int = 512) -> dict:
    """Decode step time of ``batch`` rows with every fast path on, then with each one off (its
    ``DSAGENT_*`` switch set to 0), side by side in one process: what each path is worth here."""
    times = {}
    for off in (None, *PATH_SWITCHES):
        with switched(**{name: name != off for name in PATH_SWITCHES}):
            times[off or "all_on"] = _step_seconds(model, ctx, batch, steps, chunk)
    return {"bench": "paths", "ctx": ctx, "batch": batch, "step_ms": {k: 1e3 * v for k, v in times.items()},
            "slowdown_without": {k: v / times["all_on"] for k, v in times.items() if k != "all_on"}}


def kernel_knob(knob: str) -> tuple:
    """(module, name, value on) of a kernel knob: ``"moe.UP_EARLY"`` (a boolean module
    constant of ``model.kernels``, on = True) or ``"fused.MIN_BLOCKS_PER_SPLIT=2"`` (on = that
    value, a Python literal)."""
    import ast
    import importlib

    knob, _, value = knob.partition("=")
    module, name = knob.rsplit(".", 1)
    return importlib.import_module(f"model.kernels.{module}"), name, ast.literal_eval(value) if value else True


def bench_knobs(model: Transformer, ctx: int, knobs: list[str], *, rounds: int = 2, steps: int = 8,
                chunk: int = 512) -> dict:
    """Decode step time of one row at ``ctx`` with kernel knobs (:func:`kernel_knob`: a
    boolean module constant of ``model.kernels``, off = False; or one given a value, off = the
    module's own) all off, each alone on, and all on, after one prefill: between variants the
    step's graphs are dropped and captured again, and the variants alternate for ``rounds``
    rounds (each one's best kept), so a figure is a ratio taken in one process. One constant
    may come with several values (``fused.BLOCK_N=16,fused.BLOCK_N=32``): each is a variant
    of its own, and then there is no "all on". A last variant, "control", is all off again,
    timed at the end of each round: its ratio to "all off" is the bench's own noise (on
    2026-12-03, 88b7232, read 0.2% that way, by hand, beside effects of 0.5-1.4%). The knobs
    are left as they were."""
    where = [kernel_knob(k) for k in knobs]
    saved = [getattr(module, name) for module, name, _ in where]
    off = [value if "=" in knob else False for knob, value in zip(knobs, saved)]
    repeated = len({(module.__name__, name) for module, name, _ in where}) < len(where)
    variants = {"all_off": (), **{k: (k,) for k in knobs}, **({} if repeated else {"all_on": tuple(knobs)}),
                "control": ()}
    engine = engine_for(model, mode="ced", chunk=chunk)
    state = engine.new_state(batch=1)
    engine.prefill(state, prompt_ids(model, ctx))
    token = state.last_logits.argmax(-1)
    times: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for label, on in variants.items():
                for (module, name, _), default in zip(where, off):  # every constant off, then those on
                    setattr(module, name, default)
                for (module, name, value), knob in zip(where, knobs):
                    if knob in on:
                        setattr(module, name, value)
                model.derived.clear()
                for _ in range(WARMUP_STEPS):
                    engine.decode(state, token)
                _, secs = _timed(lambda: [engine.decode(state, token) for _ in range(steps)], model.device)
                times[label] = min(times.get(label, float("inf")), secs / steps)
    finally:
        for (module, name, _), value in zip(where, saved):
            setattr(module, name, value)
        model.derived.clear()
    return {"bench": "knobs", "ctx": ctx, "rounds": rounds, "step_ms": {k: 1e3 * v for k, v in times.items()},
            "over_all_off": {k: v / times["all_off"] for k, v in times.items() if k != "all_off"}}


def layer_map(spans: list, boundary: str | None = None, layers: int | None = None) -> dict:
    """A decode step's map by layer, from a chained profile's kernels (``spans``: (start µs,
    end µs, name), as ``bench_profile(spans=)`` gives them): a layer ends where its last
    kernel, ``boundary``, ends — by default the MoE's last: the down sum (``_down_slots_kernel``),
    or where a step has none the slots' sum (``_sum_slots_kernel``: FP4 experts by pair, which
    write each pair's product and sum them). -> ``layer_us``: each layer's span, from
    the boundary's end before it to its own (the first after a step's start takes the start's
    work too), as lists of ``layers`` (a step's; None: one list of all); ``kernels``: for each
    layer of the first full step, its kernels in order of end, each (name, advance µs: how far
    the layer's last end moved when it ended — :func:`span_advances`' measure within a
    layer). What the map of a `small` step of 2026-12-04 (3097e7e) was read from
    (docs/gpu-fast-path.md)."""
    spans = sorted(spans, key=lambda s: s[1])
    if boundary is None:
        down = any(name.startswith("_down_slots_kernel") for _, _, name in spans)
        boundary = "_down_slots_kernel" if down else "_sum_slots_kernel"
    ends = [i for i, (_, _, name) in enumerate(spans) if name.startswith(boundary)]
    spans_us, kernels = [], []
    for a, b in zip(ends, ends[1:]):
        last = spans[a][1]
        spans_us.append(round(spans[b][1] - last, 3))
        inside = []
        for _, end, name in spans[a + 1:b + 1]:
            inside.append((name, round(max(0.0, end - last), 3)))
            last = max(last, end)
        kernels.append(inside)
    if layers:
        spans_us = [spans_us[i:i + layers] for i in range(0, len(spans_us), layers)]
    return {"layer_us": spans_us, "kernels": kernels[:layers] if layers else kernels}


# ----------------------------------------------------------------------------- linear layers

class _Clock:
    """Timestamps that never synchronize: CUDA events on a GPU (read them after one
    synchronize), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class _LinearTimer:
    """Forward pre/post hooks on every nn.Linear and grouped-expert GEMM of a model: per call,
    its name, FLOPs (2·M·K·N from the call's shapes) and start/end marks."""

    def __init__(self, model: nn.Module, clock: _Clock):
        self.clock, self.calls, self._open = clock, [], {}
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, GroupedLinear))}
        self._handles = [h for name, m in self.modules.items()
                         for h in (m.register_forward_pre_hook(partial(self._pre, name)),
                                   m.register_forward_hook(partial(self._post, name), with_kwargs=True))]

    def _pre(self, name: str, module, args) -> None:
        self._open[name] = self.clock.mark()

    def _post(self, name: str, module, args, kwargs, out) -> None:
        end = self.clock.mark()
        products = 2 if kwargs.get("gate") is not None else 1  # FP4 experts' w1 with w3 in one launch
        self.calls.append((name, products * gemm_flops(module, args[0], kwargs.get("rows")), self._open.pop(name), end))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class _PartTimer:
    """Forward pre/post hooks that split a forward's time by part of the model (the parts of
    ``model.census.prefill_flops``, and the MoE's dispatch and the Engram look-up, which it
    counts no FLOPs for): each call's own time, its hooked children's taken out, so the parts
    add up to the hooked time. On CUDA the marks are events: read after one synchronise."""

    def __init__(self, model: nn.Module, clock: _Clock):
        from model.block import Attention, Block, Engram
        from model.csa2 import Compressor, Indexer
        from model.moe import MoE, Gate

        kinds = ((Block, "mhc"), (Attention, "attention"), (Compressor, "compressor"), (Indexer, "indexer"),
                 (Engram, "engram"), (MoE, "moe_dispatch"), (Gate, "router"))
        self.clock, self.calls, self._stack = clock, [], []
        self._handles = []
        for name, m in model.named_modules():
            if name.startswith(("mtp.", "vision.", "aligner.")):
                continue
            if isinstance(m, (nn.Linear, GroupedLinear)):
                part = "compressor" if ".compressor." in f".{name}." or name.endswith("indexer.wk") else "linear"
            else:
                part = next((p for kind, p in kinds if isinstance(m, kind)), None)
            if part is not None:
                self._handles += [m.register_forward_pre_hook(partial(self._pre, part)),
                                  m.register_forward_hook(partial(self._post))]

    def _pre(self, part: str, module, args) -> None:
        call = [part, self.clock.mark(), None, []]  # part, start, end, children
        if self._stack:
            self._stack[-1][3].append(call)
        else:
            self.calls.append(call)
        self._stack.append(call)

    def _post(self, module, args, out) -> None:
        self._stack.pop()[2] = self.clock.mark()

    def seconds(self) -> dict[str, float]:
        """Each part's own seconds (synchronises first)."""
        _sync("cuda" if self.clock.cuda else "cpu")
        out: dict[str, float] = {}

        def walk(call) -> float:
            part, start, end, children = call
            whole = self.clock.seconds(start, end)
            out[part] = out.get(part, 0.0) + whole - sum(walk(c) for c in children)
            return whole

        for call in self.calls:
            walk(call)
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def gemm_flops(module: nn.Module, x: torch.Tensor, rows: torch.Tensor | None = None) -> int:
    """2·M·K·N of one call: the M rows of ``x`` (or ``x[rows]``, a grouped call's rows read in
    place) against an [N, K] weight (each expert's own [N, K] for a grouped call, whose groups
    together hold the M rows)."""
    m_k = x.numel() if rows is None else rows.numel() * x.shape[-1]  # a packed weight's K is not its last dim
    return 2 * m_k * module.weight.shape[-2]


_KINDS = ((".shared_experts.", "shared_experts"), (".experts.", "routed_experts"), (".grouped.", "routed_experts"),
          (".indexer.", "indexer"), (".compressor.", "compressor"), (".attn.", "attention"),
          (".engram.", "engram"), (".head.", "head"))


def linear_kind(name: str) -> str:
    """The part of the model a linear layer belongs to, from its module name."""
    return next((kind for part, kind in _KINDS if part in f".{name}."), "other")


def median_seconds(fn, device, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls run back to back (a mark between
    each, no synchronize until the last), after ``warmup`` calls."""
    clock = _Clock(device)
    for _ in range(warmup):
        fn()
    marks = [clock.mark()]
    for _ in range(repeats):
        fn()
        marks.append(clock.mark())
    _sync(device)
    return statistics.median(clock.seconds(s, e) for s, e in zip(marks, marks[1:]))


def matmul_tflops(n: int, dtype: torch.dtype, device, repeats: int = 5) -> float:
    """Median TFLOP/s of one dense n×n×n product after two warm-up products."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n ** 3 / median_seconds(lambda: a @ b, device, repeats, warmup=2) / 1e12


def bench_linears(model: Transformer, tokens: int = 8192, *, matmul_size: int | None = None,
                  repeats: int = 5) -> dict:
    """The prefill's linear layers against the device's dense matmul rate, measured in one run.
    The rate: an n×n×n product (bf16, n = 8192 on CUDA; the model's dtype, n = 2048 on the CPU).
    The linears: every nn.Linear and grouped-expert call of one exact prefill chunk of
    ``tokens`` random tokens (on CUDA after a warm-up chunk), timed between forward pre/post hooks.
    On CUDA the marks are events timed on the GPU, so a GEMM the GPU waits for the CPU to
    launch counts its wait too. ``linears_not_called``: linear layers of the backbone whose
    weights the forward reads without calling them (their GEMMs are not in the totals)."""
    device = model.device
    cuda = device.type == "cuda"
    size, dtype, peak = _matmul_rate(model, matmul_size, repeats)
    engine, ids = engine_for(model, mode="exact", chunk=tokens), prompt_ids(model, tokens)
    if cuda:  # warm-up: the allocator's blocks and the GEMM handles, or the timed run would pay for them
        engine.prefill(engine.new_state(), ids)
    timer = _LinearTimer(model, _Clock(device))
    try:
        _, prefill_s = _timed(lambda: engine.prefill(engine.new_state(), ids), device)
    finally:
        timer.close()
    kinds = _by_kind(timer, peak, linear_kind)
    formats = _by_kind(timer, peak, lambda name: getattr(timer.modules[name], "fmt", "plain"))
    flops, secs = sum(k["flops"] for k in kinds.values()), sum(k["seconds"] for k in kinds.values())
    return {"bench": "linears", "tokens": tokens, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "moe_path": "grouped" if any(".grouped." in c[0] for c in timer.calls) else "loop",
            "matmul_size": size, "matmul_tflops": peak, "linear_flops": flops, "linear_seconds": secs,
            "linear_tflops": flops / secs / 1e12, "linear_over_matmul": flops / secs / 1e12 / peak,
            "prefill_seconds": prefill_s, "linear_share_of_prefill": secs / prefill_s,
            "by_kind": kinds, "by_format": formats, "linears_not_called": _not_called(timer)}


def _by_kind(timer: _LinearTimer, peak: float, kind_of) -> dict:
    """The timed calls summed by ``kind_of(module name)``, each kind's rate over ``peak``."""
    kinds: dict[str, dict] = {}
    for name, flops, start, end in timer.calls:
        k = kinds.setdefault(kind_of(name), {"calls": 0, "flops": 0, "seconds": 0.0})
        k["calls"] += 1
        k["flops"] += flops
        k["seconds"] += timer.clock.seconds(start, end)
    for k in kinds.values():
        k["tflops"] = k["flops"] / k["seconds"] / 1e12
        k["over_matmul"] = k["tflops"] / peak
    return kinds


def _not_called(timer: _LinearTimer) -> dict[str, list[int]]:
    """Backbone linears no call reached, as {name within a layer: layer numbers}; routed experts
    are left out (an expert without tokens, or the grouped path, calls none)."""
    called, out = {c[0] for c in timer.calls}, {}
    for name, m in timer.modules.items():
        layer = re.match(r"layers\.(\d+)\.(.+)", name)
        if layer and isinstance(m, nn.Linear) and name not in called and linear_kind(name) != "routed_experts":
            out.setdefault(layer[2], []).append(int(layer[1]))
    return out


# ----------------------------------------------------------------------------- decode profile

def bench_host(model: Transformer, ctx: int, *, steps: int = 16, chunk: int = 512) -> dict:
    """Is a batch-1 decode step bound by the host? The step's wall time (``steps`` in a row,
    synchronised at the end) beside the host's time to issue one step's work (from a
    synchronised device to the call's return, the device still running it). Where the two
    are close, the device waits on Python, and faster kernels cannot shorten the step."""
    step = _warm_decoder(model, ctx, 1, chunk)
    _, secs = _timed(lambda: [step() for _ in range(steps)], model.device)
    issue = []
    for _ in range(steps):
        _sync(model.device)
        t = time.perf_counter()
        step()
        issue.append(time.perf_counter() - t)
    _sync(model.device)
    issue.sort()
    return {"bench": "host", "ctx": ctx, "step_ms": secs / steps * 1e3, "host_issue_ms": issue[len(issue) // 2] * 1e3,
            "host_over_step": issue[len(issue) // 2] / (secs / steps)}


def bench_profile(model: Transformer, ctx: int, *, batch: int = 1, steps: int = 4, chunk: int = 512,
                  top: int = 12, chained: bool = False, spans: list | None = None) -> dict:
    """Where a decode step's device time goes, by kernel (torch.profiler over ``steps`` steps
    of ``batch`` rows after a CED prefill of ``ctx`` tokens): kernels launched per step, their
    summed device time per step, and the ``top`` kernels by time. A guide for fusing, not
    a target; on the CPU it counts operators instead of kernels. The kernels launch plainly
    here (``DSAGENT_PDL=0``): a dependent launch's time includes its wait for the kernel
    before (2026-12-02, 51f0d94: 7.8 ms "busy" in a 5.9 ms step), so only plain launches give each
    kernel's own time. ``chained``: as the step runs, dependent launches on — then the
    summary's ``advance`` (each kernel's share of the step's span: how far the last end
    moved when it ended) is the one to read, not the busy time. ``spans``: a list that gets
    every kernel's (start µs, end µs, name), in order of start (the step's timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with switched(pdl=chained):
        step = _warm_decoder(model, ctx, batch, chunk)
        cuda = model.device.type == "cuda"
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        _sync(model.device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            _sync(model.device)
    return {"bench": "profile", "ctx": ctx, "batch": batch, "dependent_launches": chained,
            **profile_summary(prof, cuda, steps, top, spans)}


def bench_prefill_profile(model: Transformer, ctx: int, *, mode: str = "ced", chunk: int | None = None,
                          top: int = 30) -> dict:
    """Where a prefill's device time goes, by kernel: torch.profiler over one ``mode`` prefill
    of ``ctx`` random tokens after one of the same length (the builds and the allocator's
    blocks). As :func:`bench_profile`, a guide for the kernels, not a target."""
    from torch.profiler import ProfilerActivity, profile

    engine, ids = engine_for(model, mode=mode, chunk=chunk), prompt_ids(model, ctx)
    engine.prefill(engine.new_state(), ids)
    cuda = model.device.type == "cuda"
    _sync(model.device)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        engine.prefill(engine.new_state(), ids)
        _sync(model.device)
    return {"bench": "prefill_profile", "ctx": ctx, "mode": mode, "chunk": engine.chunk,
            **profile_summary(prof, cuda, 1, top)}


def profile_summary(prof, cuda: bool, steps: int, top: int = 12, spans_out: list | None = None) -> dict:
    """A torch.profiler run of ``steps`` steps, per step: kernels launched and their summed
    device time (on the CPU: top-level operators and their time), and the ``top`` names by
    time. ``spans_out``: as :func:`bench_profile`'s ``spans``."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind]
    if not cuda:  # top-level operators only: nested ones would count twice
        events = [e for e in events if e.cpu_parent is None]
    total: dict[str, list[float]] = {}
    for e in events:
        us = e.device_time if cuda else e.cpu_time
        entry = total.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    busy = sum(t for _, t in total.values())
    gaps = {}
    if cuda and events:  # the idle device time between one kernel's end and the next one's start
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
        if spans_out is not None:
            spans_out.extend(spans)
        idle = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
        widest = sorted(range(len(idle)), key=lambda i: -idle[i])[:6]
        gaps = {"gap_ms_per_step": sum(idle) / 1e3 / steps,
                "gaps_over_10us_ms_per_step": sum(g for g in idle if g > 10) / 1e3 / steps,
                "median_gap_us": sorted(idle)[len(idle) // 2] if idle else 0.0,
                "widest_gaps": [{"us": idle[i], "after": spans[i][2][:50], "before": spans[i + 1][2][:50]}
                                for i in widest]}
        gaps.update(span_advances(spans, steps, top))
    return {"steps": steps, "unit": "kernel" if cuda else "operator",
            "launches_per_step": len(events) / steps, "busy_ms_per_step": busy / 1e3 / steps, **gaps,
            "top": _ranked(total, steps, top, busy)}


def _ranked(total: dict, steps: int, top: int, whole: float) -> list[dict]:
    """The ``top`` names of ``total`` (name -> [calls, µs] over ``steps`` steps) by time, per
    step, each with its share of ``whole`` µs."""
    ranked = sorted(total.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name[:90], "calls_per_step": n / steps, "ms_per_step": us / 1e3 / steps,
             "share": us / whole if whole else 0.0} for name, (n, us) in ranked]


HOST_GAP_US = 20.0  # an idle device longer than this between kernels waited on the host


def span_advances(spans: list, steps: int, top: int) -> dict:
    """Each kernel's share of a step's span, from its (start, end, name) in µs: walking the
    ends in order, how far the last end moved when this kernel ended (where
    kernels overlap — dependent launches wait inside the kernel, a split runs beside — the
    busy time counts the overlap twice, this does not). An idle device longer than
    HOST_GAP_US before a kernel's start counts as the host's, not the kernel's. -> ms per
    step: the span less the host's gaps, those gaps, and the ``top`` names by advance."""
    advance: dict[str, list] = {}
    host, last = 0.0, None
    for start, end, name in sorted(spans, key=lambda s: s[1]):
        last = start if last is None else last
        if start - last > HOST_GAP_US:
            host, last = host + start - last, start
        entry = advance.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += max(0.0, end - last)
        last = max(last, end)
    total = sum(us for _, us in advance.values())
    return {"advance_ms_per_step": total / 1e3 / steps, "host_gaps_ms_per_step": host / 1e3 / steps,
            "top_advance": _ranked(advance, steps, top, total)}
