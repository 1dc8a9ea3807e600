"""The loaded model as the application sees it: weights, tokenizer, engine, fingerprint.

Owns: choosing the model (``--model DIR``, ``--preset NAME`` or the embedded default),
the runtime settings (device, dtype, compute threads, prefill mode, context limit, the
number of GPUs the model is split over: ``dsagent.ranks``), and turning image bytes into
span embeddings (one path for user images and tool images). Does not own the turn loop
(``dsagent.agent``) or any printing.

Importing this module imports neither torch nor the model (``Runtime.load`` does), so the
command line can name the embedded default without paying for them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsagent.threads import apply_threads, settle_threads

if TYPE_CHECKING:
    import torch

    from dsagent.ranks import Ranks
    from model.engine import Engine
    from model.linear import World
    from model.model import Transformer
    from model.tokenizer import Tokenizer

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "model" / "assets" / "default"


@dataclass
class Settings:
    """Runtime settings: never part of ModelArgs."""
    model: str | None = None  # checkpoint directory; None = the embedded default
    preset: str | None = None  # random weights of a preset instead of a checkpoint
    seed: int = 0  # weight seed for presets
    device: str = "cpu"
    dtype: str = "float32"
    prefill: str = "ced"  # or "exact"
    chunk: int | None = None  # prefill chunk (tokens); None: the engine's default for the device
    max_context: int | None = None
    threads: int | None = None  # torch's threads; None = the CPUs this process may use
    weights: str = "plain"  # or "packed": the FP8 / FP4 families held as the checkpoint stores them
    gpus: int = 1  # processes (one a GPU on CUDA) the model is split over, this one driving the rest
    engram: str = "device"  # or "host": the Engram tables whole in host memory (``model.loading.load``)
    layers: int | None = None  # a preset cut to this many layers, every kind kept (``ModelArgs.preset``)
    engram_rows: int | None = None  # a preset's Engram tables of about this many rows each


def default_source() -> str:
    return str(EMBEDDED_MODEL) if (EMBEDDED_MODEL / "config.json").is_file() else "tiny"


class Runtime:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, engine: Engine, fingerprint: str, source: str,
                 ranks: Ranks | None = None):
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.fingerprint, self.source = fingerprint, source
        self.ranks = ranks  # the follower processes this one started (``--gpus N``), or None
        self._spans: dict[str, torch.Tensor] = {}

    @classmethod
    def load(cls, settings: Settings, progress=None, world: World | None = None) -> "Runtime":
        """The model of ``settings``; over ``settings.gpus`` ranks this process starts (or
        ``world``'s, given by its launcher: a follower, or a torchrun rank), rank 0 driving
        the others through a ``model.lockstep.Leader``."""
        import torch

        from model.engine import Engine
        from model.loading import fingerprint, load
        from model.lockstep import Leader
        from model.tokenizer import Tokenizer

        apply_threads(settings.threads)
        ranks = None
        if world is None and settings.gpus > 1:
            from dsagent import ranks as started

            ranks = started.start(settings, settings.gpus)
            world = ranks.world
        try:
            source = settings.preset or settings.model or default_source()
            dtype = getattr(torch, settings.dtype)
            options = {} if world is None else {"world": world}
            if settings.layers or settings.engram_rows:
                from model.args import ModelArgs

                options["args"] = ModelArgs.preset(source, layers=settings.layers, engram_rows=settings.engram_rows)
            model = load(source, device=settings.device, dtype=dtype, seed=settings.seed, progress=progress,
                         weights=settings.weights, engram=settings.engram, **options)
            tokenizer = Tokenizer.of(model)
            settle_threads(model, settings.threads)
            leads = world is not None and world.size > 1 and world.rank == 0
            engine = (Leader(model, world, mode=settings.prefill, chunk=settings.chunk, max_context=settings.max_context)
                      if leads else
                      Engine(model, mode=settings.prefill, chunk=settings.chunk, max_context=settings.max_context))
        except BaseException:
            if ranks is not None:
                ranks.stop()
            raise
        return cls(model, tokenizer, engine, fingerprint(model, source, settings.seed), source, ranks)

    def close(self) -> None:
        """The other ranks, if any, leave (each at most once). The model's captured decode
        graphs go first: a graph holding NCCL collectives can keep the process group from
        being destroyed (a known PyTorch behaviour, torch issue 115388)."""
        from model.lockstep import Leader

        if self.ranks is not None:
            self.model.derived.clear()
            self.ranks.close(self.engine)
        elif isinstance(self.engine, Leader):
            self.engine.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, kind, exc, trace) -> None:
        """Over several ranks, an error here that a failed follower caused (a collective whose
        peer is gone) is reported as that follower's failure, with its traceback."""
        if exc is not None and not isinstance(exc, KeyboardInterrupt) and self.ranks is not None:
            report = self.ranks.failed()
            if report is not None:
                self.ranks.stop()
                self.ranks.on_failure(report)
        self.close()

    @property
    def args(self):
        return self.model.args

    @property
    def reads_images(self) -> bool:
        return self.args.vision is not None

    def image_span(self, data: bytes) -> tuple[str, torch.Tensor]:
        """(sha256, span embeddings [n, D]) of image bytes; raises ImageError on bad input."""
        from model.vision import decode_image

        sha = hashlib.sha256(data).hexdigest()
        if sha not in self._spans:
            if not self.reads_images:
                raise ValueError("this model has no vision tower, so it cannot read images")
            self._spans[sha] = self.model.encode_image(decode_image(data))
        return sha, self._spans[sha]
