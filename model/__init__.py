"""The V4.1 model package: architecture, cache, engine, tokenizer, checkpoints.

Public entry point: ``load(path_or_preset, device="cpu", dtype=torch.float32)`` returns a
:class:`model.model.Transformer` in eval mode whose call ``m(input_ids)`` is the exact
full forward. Imports nothing from ``dsagent``, ``sessions`` or ``tools``.

``load`` is looked up when first asked for (PEP 562), so importing a torch-free
submodule (``model.args``, ``model.chat``) does not import torch: the command line reads
those to check its flags before anything loads.
"""
__all__ = ["load"]


def __getattr__(name: str):
    if name == "load":
        from model.loading import load

        return load
    raise AttributeError(f"module 'model' has no attribute {name!r}")
