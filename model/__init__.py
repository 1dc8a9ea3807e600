"""The V4.1 model package: architecture, cache, engine, tokenizer, checkpoints.

Public entry point: ``load(path_or_preset, device="cpu", dtype=torch.float32)`` returns a
:class:`model.model.Transformer` in eval mode whose call ``m(input_ids)`` is the exact
full forward. Imports nothing from ``dsagent``, ``sessions`` or ``tools``.
"""
from model.loading import load

__all__ = ["load"]
