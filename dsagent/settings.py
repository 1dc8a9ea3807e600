"""User defaults of the CLI: `$DSAGENT_HOME/config.toml` < environment < flags.

Owns: the few defaults a person may want to set once (model, preset, approval policy,
thinking mode, max new tokens, sampling temperature) and where they come from. Flags
win; a command passes its flag values (None when not given) to `resolve`. Does not own
the runtime settings of a loaded model (`dsagent.runtime.Settings`) nor the store's
location (`sessions.default_home`, which reads `DSAGENT_HOME`).

    # ~/.local/share/dsagent/config.toml (or $DSAGENT_HOME/config.toml)
    model = "/models/v41-small"     # or: preset = "tiny"
    policy = "ask"                  # ask | yes | deny
    thinking = "chat"               # chat | thinking
    max_new_tokens = 512
    temperature = 0.0
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from sessions import default_home

CONFIG_NAME = "config.toml"


class ConfigFileError(ValueError):
    """config.toml cannot be read or holds an unknown key or a wrong type."""


@dataclass(frozen=True)
class Defaults:
    model: str | None = None
    preset: str | None = None
    policy: str = "ask"
    thinking: str = "chat"
    max_new_tokens: int = 256
    temperature: float = 0.0


_ENV = {f.name: "DSAGENT_" + f.name.upper() for f in fields(Defaults)}


def config_path() -> Path:
    return default_home() / CONFIG_NAME


def _typed(name: str, value, source: str):
    kind = {f.name: f.type for f in fields(Defaults)}[name]
    try:
        return int(value) if "int" in kind else float(value) if "float" in kind else str(value)
    except (TypeError, ValueError):
        raise ConfigFileError(f"{source}: {name} = {value!r} is not a {kind}") from None


def _from_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{path} is not valid TOML ({e}); fix or remove it") from None
    unknown = sorted(set(data) - set(_ENV))
    if unknown:
        raise ConfigFileError(f"{path}: unknown key(s) {unknown}; known: {sorted(_ENV)}")
    return {k: _typed(k, v, str(path)) for k, v in data.items()}


def _from_env() -> dict:
    return {k: _typed(k, os.environ[var], var) for k, var in _ENV.items() if os.environ.get(var)}


def resolve(**flags) -> Defaults:
    """Defaults from config.toml, then the environment, then the flags that were given."""
    given = {k: v for k, v in flags.items() if v is not None}
    merged = {**_from_file(config_path()), **_from_env(), **given}
    if "model" in given or "preset" in given:  # a flag chooses the model; drop the other source
        merged = {**merged, "model": given.get("model"), "preset": given.get("preset")}
    return replace(Defaults(), **merged)
