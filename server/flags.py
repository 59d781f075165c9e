"""The `deltaserve serve` flags, generated from the config keys (server/settings.py).

Each flag's help says what the key does, its allowed values, and its EFFECTIVE default:
the value it gets when the flag is left out, i.e. from $DELTASERVE_* or the config file
when one of those sets it (named, with the built-in default next to it), else built-in.
Flags themselves default to "unset" so load_settings can tell them from the lower layers.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Mapping, Sequence
from types import NoneType, UnionType
from typing import Any

from deltaserve.server.settings import (
    CONFIG_KEYS,
    ConfigError,
    ConfigKey,
    config_path,
    dest,
    layered_values,
)

# Metavars by key where the type alone says too little, then by type.
KEY_METAVARS = {
    "model.path": "PATH",
    "model.served_name": "NAME",
    "server.host": "HOST",
    "server.api_key": "KEY",
    "server.cors_origins": "ORIGIN,...",
    "images.local_dir": "DIR",
}
TYPE_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT"}

Shown = Mapping[str, tuple[Any, str]]  # key -> (value, where it came from)


def effective_defaults(argv: Sequence[str], env: Mapping[str, str]) -> Shown:
    """The values the config file and env give each key, for --help to show.

    A broken file or env value shows built-ins here: the real load reports the error.
    """
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(argv)
    try:
        return layered_values(config_path(known.config, env), env)
    except ConfigError:
        return {}


def add_arguments(parser: argparse.ArgumentParser, shown: Shown | None = None) -> None:
    """Add --config and one flag per config key to `parser` (all default to unset)."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="config.yaml to read (default: $DELTASERVE_CONFIG, else ./config.yaml if present)",
    )
    for ck in CONFIG_KEYS:
        help_text = _help(ck, (shown or {}).get(ck.key)).replace("%", "%%")  # argparse formats
        if _bare_type(ck.type) is bool:
            parser.add_argument(
                ck.flag, dest=dest(ck), action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(ck.flag, dest=dest(ck), metavar=metavar(ck), help=help_text)


def metavar(ck: ConfigKey) -> str:
    """{a,b,c} for a fixed set of values, else a name for the kind of value expected."""
    if ck.choices:
        return "{" + ",".join(str(choice) for choice in ck.choices) + "}"
    return KEY_METAVARS.get(ck.key) or TYPE_METAVARS.get(_bare_type(ck.type), "VALUE")


def _help(ck: ConfigKey, shown: tuple[Any, str] | None) -> str:
    default = f"default: {format_value(ck.default)}"
    if shown is not None:
        value, source = shown
        default = (
            f"default: {format_value(value)} from {source}, built-in {format_value(ck.default)}"
        )
    return f"{ck.description} ({default}; env {ck.env})"


def format_value(value: Any) -> str:
    """A value as one would type it on the command line."""
    if value is None or value in ("", ()):
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(str(item) for item in value)
    return str(value)


def _bare_type(tp: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    if typing.get_origin(tp) in (typing.Union, UnionType):
        return next(arg for arg in typing.get_args(tp) if arg is not NoneType)
    return tp
