"""User defaults of the CLI: `$DSAGENT_HOME/config.toml` < environment < flags.

Owns: the few defaults a person may want to set once (model, preset, approval policy,
thinking mode, max new tokens, sampling temperature, compute threads, the shared prefix
cache) and where they come from. Flags
win; a command passes its flag values (None when not given) to `resolve`. Does not own
the runtime settings of a loaded model (`dsagent.runtime.Settings`) nor the store's
location (`sessions.default_home`, which reads `DSAGENT_HOME`). Every value is checked
against what its flag accepts, whatever its source, before a command loads or stores
anything.

    # ~/.local/share/dsagent/config.toml (or $DSAGENT_HOME/config.toml)
    model = "/models/v41-small"     # or: preset = "tiny"
    policy = "ask"                  # ask | yes | deny
    thinking = "chat"               # chat | thinking
    max_new_tokens = 512
    temperature = 0.0
    threads = 4                     # torch's threads (default: the CPUs this process may use)
    prefix_cache = false            # a new session prefills its system prompt itself (default: true)

Imports neither torch nor the model: `dsagent --help` and every refusal of a bad setting
run without them.
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from model.chat import THINKING_MODES
from sessions import default_home
from tools import POLICIES

CONFIG_NAME = "config.toml"


class SettingError(ValueError):
    """A setting, from config.toml, a DSAGENT_ variable or a flag, that cannot be used: its
    message names the setting and where it came from (a usage error, exit 2)."""


class ConfigFileError(SettingError):
    """config.toml cannot be read or holds an unknown key."""


class FlagError(SettingError):
    """Flags or arguments that cannot work together, or name something that is not there
    (an unknown tool, a missing image): a usage error, exit 2. A SettingError, so that it
    is refused without importing anything heavy (`dsagent.failures`)."""


@dataclass(frozen=True)
class Defaults:
    model: str | None = None
    preset: str | None = None
    policy: str = "ask"
    thinking: str = "chat"
    max_new_tokens: int = 256
    temperature: float = 0.0
    threads: int | None = None  # None: the CPUs this process may use (dsagent.threads)
    prefix_cache: bool = True  # a new session reuses KV stored for the same prefix by other sessions


_ENV = {f.name: "DSAGENT_" + f.name.upper() for f in fields(Defaults)}
_FLAG = {name: "--" + name.replace("_", "-") for name in _ENV}
# What each flag accepts, so config.toml and the environment cannot set what the flag refuses
# (click's float range lets nan through, hence isfinite).
_RULES = {
    "policy": (lambda v: v in POLICIES, f"is not one of {', '.join(POLICIES)}"),
    "thinking": (lambda v: v in THINKING_MODES, f"is not one of {', '.join(THINKING_MODES)}"),
    "max_new_tokens": (lambda v: v >= 1, "is not 1 or more"),
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "is not a finite number, 0 or more"),
    "threads": (lambda v: v >= 1, "is not 1 or more"),
}


def config_path() -> Path:
    return default_home() / CONFIG_NAME


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _typed(name: str, value, source: str):
    kind = {f.name: f.type for f in fields(Defaults)}[name]
    if kind == "bool":
        typed = value if isinstance(value, bool) else _BOOLS.get(str(value).strip().lower())
        if typed is None:
            raise SettingError(f"{source}: {name} = {value!r} is not a boolean (true or false, 1 or 0)")
        return typed
    try:
        typed = int(value) if "int" in kind else float(value) if "float" in kind else str(value)
    except (TypeError, ValueError):
        raise SettingError(f"{source}: {name} = {value!r} is not a {kind}") from None
    return _checked(name, typed, source)


def _checked(name: str, value, source: str):
    """`value`, if the setting's flag would accept it; else a SettingError naming `source`."""
    accepts, why = _RULES.get(name, (lambda v: True, ""))
    if not accepts(value):
        where = source if source == _FLAG[name] else f"{source}: {name} ="
        raise SettingError(f"{where} {value!r} {why}")
    return value


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
    given = {k: _checked(k, v, _FLAG[k]) for k, v in flags.items() if v is not None}
    merged = {**_from_file(config_path()), **_from_env(), **given}
    if "model" in given or "preset" in given:  # a flag chooses the model; drop the other source
        merged = {**merged, "model": given.get("model"), "preset": given.get("preset")}
    return replace(Defaults(), **merged)
