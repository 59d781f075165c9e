"""One config source for `deltaserve serve`: frozen dataclasses, filled in layers.

Precedence, highest first:

    1. CLI flag                 --max-num-seqs 64
    2. environment variable     DELTASERVE_MAX_NUM_SEQS=64
    3. config.yaml              engine: {max_num_seqs: 64}
    4. built-in defaults        the dataclass field defaults below (and EngineConfig's)

The YAML file is `--config PATH`, else `$DELTASERVE_CONFIG`, else ./config.yaml when it
exists. Every key has exactly one flag and one env var, both derived from the field
(`FLAG_NAMES` lists the few renamed ones); the env var is the flag upper-cased with a
DELTASERVE_ prefix (--kv-bits -> DELTASERVE_KV_BITS). Each layer gets its own section
only: the engine receives `settings.engine`, an `deltaserve.engine.config.EngineConfig`. The flags
themselves (help text, metavars, choices) are built in server/flags.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import re
import textwrap
import tokenize
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

import yaml

from deltaserve.engine.config import DISTRIBUTED_BACKENDS, EngineConfig
from deltaserve.engine.types import InvalidRequestError, SamplingParams

ENV_PREFIX = "DELTASERVE_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """A bad config value; the message names the key and where the value came from."""


@dataclass(frozen=True)
class ModelSettings:
    """Which checkpoint to serve and under which name."""

    path: str = ""  # local directory or hub id
    served_name: str = ""  # the `model` name clients send; "" = the hub id or directory name

    @property
    def name(self) -> str:
        """The name /v1/models lists: served_name, else the hub id or directory name."""
        if self.served_name:
            return self.served_name
        local = Path(self.path).expanduser()
        return local.name if local.is_dir() else self.path.rstrip("/")


@dataclass(frozen=True)
class ServerSettings:
    """HTTP front door."""

    host: str = "127.0.0.1"  # address to bind; 0.0.0.0 = every interface
    port: int = 8000  # TCP port; 0 = any free port
    api_key: str | None = None  # when set, requests need `Authorization: Bearer <key>`
    cors_origins: tuple[str, ...] = ()  # browser origins allowed (a,b); none = no CORS headers
    log_level: str = "info"  # uvicorn's and deltaserve's log level
    keepalive: float = 5.0  # seconds between SSE comments while no token has come
    # the engine loop in a process of its own (engine/engine_process.py): the HTTP side's
    # Python never holds its GIL; not with tensor parallelism
    engine_process: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("server.port must be in [0, 65535]")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"server.log_level must be one of {', '.join(LOG_LEVELS)}")
        if not self.keepalive > 0:
            raise ConfigError("server.keepalive must be > 0 seconds")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves out."""

    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_tokens: int = 2048  # completion length cap; also capped by the context left

    def __post_init__(self) -> None:
        # The engine's own checks, so the ranges are written once (engine/types.py).
        try:
            SamplingParams(**dataclasses.asdict(self))
        except InvalidRequestError as e:
            raise ConfigError(f"sampling.{e.param}: {e}") from None


@dataclass(frozen=True)
class ImageSettings:
    """Images in chat messages (image_url parts): where they may come from, how big."""

    max_per_request: int = 8  # images one request may carry; 0 = no images
    max_pixels: int = 4096 * 4096  # width x height of one decoded image, before resizing
    # Larger images are scaled down (aspect kept) to at most this area before the tower
    # (the checkpoint's own bound when that is lower): 1024^2 = 1,024 tokens an image. The
    # tower's attention grows with the square of an image's patches.
    max_resized_pixels: int = 1024 * 1024
    max_bytes: int = 20 * 2**20  # encoded size of one image (data URL, file or download)
    data_urls: bool = True  # accept data: URLs (base64 PNG, JPEG, WebP, GIF)
    local_dir: str = ""  # accept file:// URLs and paths under this directory; "" = none
    http: bool = False  # fetch http(s) URLs (the server then reaches any host it can)
    http_timeout: float = 10.0  # seconds one download may take, redirects included
    http_max_redirects: int = 3  # redirects one download may follow

    def __post_init__(self) -> None:
        if self.max_per_request < 0:
            raise ConfigError("images.max_per_request must be >= 0")
        if self.max_pixels < 1 or self.max_bytes < 1:
            raise ConfigError("images.max_pixels and images.max_bytes must be >= 1")
        if self.max_resized_pixels < 32 * 32:
            raise ConfigError("images.max_resized_pixels must be >= 1024 (one token)")
        if not self.http_timeout > 0 or self.http_max_redirects < 0:
            raise ConfigError("images.http_timeout must be > 0, http_max_redirects >= 0")
        if self.local_dir and not Path(self.local_dir).expanduser().is_dir():
            raise ConfigError(f"images.local_dir {self.local_dir!r} is not a directory")


@dataclass(frozen=True)
class ResponseStoreSettings:
    """/v1/responses kept in memory (store: true) for previous_response_id and GET; the
    least recently used go first once either bound is reached."""

    max_stored: int = 1000  # responses kept; 0 = none (previous_response_id is then a 404)
    max_stored_bytes: int = 64 * 2**20  # their JSON size, each with its whole input

    def __post_init__(self) -> None:
        if self.max_stored < 0 or self.max_stored_bytes < 0:
            raise ConfigError("responses.max_stored and max_stored_bytes must be >= 0")


@dataclass(frozen=True)
class Settings:
    """Everything `deltaserve serve` is configured with, one section per layer."""

    model: ModelSettings = field(default_factory=ModelSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    images: ImageSettings = field(default_factory=ImageSettings)
    responses: ResponseStoreSettings = field(default_factory=ResponseStoreSettings)


# Flags that are not simply --<field-name>: short ones for the common keys, and a prefix
# where a bare field name would be ambiguous (sampling.max_tokens vs a request's).
FLAG_NAMES = {
    "model.path": "model",
    "model.served_name": "served-model-name",
    "engine.kv_cache.kind": "kv-cache",
}
SECTION_PREFIXES = {
    "engine.kv_cache": "kv-",
    "sampling": "default-",
    "images": "image-",
    "responses": "responses-",
}
# A key's description is its field's trailing comment. KVCacheConfig (engine/config.py)
# documents its fields in the class docstring instead, and max_context's comment only
# gives the meaning of 0, so those are described here.
DESCRIPTIONS = {
    "engine.max_context": "longest prompt + completion in tokens; 0 = the model's maximum",
    "engine.kv_cache.kind": "KV store of the attention layers",
    "engine.kv_cache.bits": "affine: bits per quantized KV value",
    "engine.kv_cache.group_size": "affine: values sharing one scale and bias",
    "engine.kv_cache.key_bits": "turboquant: bits per key code",
    "engine.kv_cache.value_bits": "turboquant: bits per value code",
    "engine.kv_cache.start": "affine/turboquant: leading tokens of a row kept unquantized",
}
# Keys with a fixed set of values, shown in --help. The dataclasses still validate (and
# tests/test_server_settings.py checks these lists against them).
CHOICES: dict[str, tuple[Any, ...]] = {
    "server.log_level": LOG_LEVELS,
    "engine.kv_cache.kind": ("fp", "affine", "turboquant"),
    "engine.kv_cache.bits": (4, 8),
    "engine.kv_cache.group_size": (32, 64, 128),
    "engine.distributed_backend": DISTRIBUTED_BACKENDS,
}


@dataclass(frozen=True)
class ConfigKey:
    """One leaf of Settings: its dotted key, flag, env var, type, default and description."""

    key: str  # "engine.kv_cache.bits"
    flag: str  # "--kv-bits"
    env: str  # "DELTASERVE_KV_BITS"
    type: Any
    default: Any
    description: str = ""  # one line for --help
    choices: tuple[Any, ...] = ()  # the allowed values, when there is a fixed set


def _field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}, read from cls's source: the comment at the end of the
    field's line, else the comment lines right above it (joined into one line)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app, REPL class): no descriptions
        return {}
    # tokenize, not a regex, so a "#" inside a default string is never taken as a comment.
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comment_at = {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}
    comments: dict[str, str] = {}
    above: list[str] = []
    for number, line in enumerate(source.splitlines(), start=1):
        comment = comment_at.get(number, "")
        text = comment.lstrip("#").strip()
        if comment and line.strip() == comment:
            above.append(text)
            continue
        field_name = re.match(r"\s+(\w+)\s*:", line)
        if field_name and (text or above):
            comments[field_name.group(1)] = text or " ".join(above)
        above = []
    return comments


def _leaves(cls: type, prefix: str) -> list[ConfigKey]:
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    keys: list[ConfigKey] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaves(hints[f.name], key)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        name = FLAG_NAMES.get(key, SECTION_PREFIXES.get(prefix, "") + f.name.replace("_", "-"))
        env = ENV_PREFIX + name.upper().replace("-", "_")
        description = DESCRIPTIONS.get(key, comments.get(f.name, ""))
        keys.append(
            ConfigKey(
                key, f"--{name}", env, hints[f.name], default, description, CHOICES.get(key, ())
            )
        )
    return keys


CONFIG_KEYS = _leaves(Settings, "")
assert len({k.flag for k in CONFIG_KEYS}) == len(CONFIG_KEYS), "two config keys share a flag"


def _parse_scalar(text: str, tp: Any) -> Any:
    """Turn an env var or flag string into a value of `tp` (before type checking)."""
    if typing.get_origin(tp) in (typing.Union, UnionType) and NoneType in typing.get_args(tp):
        if text.lower() in ("", "none", "null"):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not NoneType)
    if tp is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        return text
    if typing.get_origin(tp) is tuple:
        return [part.strip() for part in text.split(",") if part.strip()]
    for convert in (int, float):
        if tp is convert:
            try:
                return convert(text)
            except ValueError:
                return text
    return text


def _check_type(value: Any, ck: ConfigKey, source: str) -> Any:
    """Return `value` as ck.type, or raise ConfigError naming the key and source."""
    tp, optional = ck.type, False
    if typing.get_origin(tp) in (typing.Union, UnionType):
        optional, tp = True, next(a for a in typing.get_args(tp) if a is not NoneType)
    ok = (
        (value is None and optional)
        or (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if typing.get_origin(tp) is tuple and isinstance(value, str):
        value = [value]
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        ok = all(isinstance(v, str) for v in value)
        value = tuple(value)
    if not ok:
        want = getattr(tp, "__name__", str(tp))
        raise ConfigError(f"{ck.key}: expected {want}, got {value!r} (from {source})")
    return float(value) if tp is float and value is not None else value


def _flatten_yaml(data: Any, prefix: str, source: str) -> dict[str, Any]:
    if data is None:
        return {}  # a section whose keys are all commented out
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping (from {source})")
    known = {k.key for k in CONFIG_KEYS}
    flat: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in known:
            flat[key] = value
        elif any(k.startswith(key + ".") for k in known):
            flat.update(_flatten_yaml(value, key, source))
        else:
            raise ConfigError(f"unknown config key {key!r} (from {source})")
    return flat


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, key)
        elif key in values:
            kwargs[f.name] = values[key]
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # EngineConfig / KVCacheConfig checks name their own field
        raise ConfigError(f"invalid {prefix} config: {e}") from None


def config_path(flag_value: str | None, env: Mapping[str, str]) -> str | None:
    """The YAML file to read: --config, else $DELTASERVE_CONFIG, else ./config.yaml if present."""
    path = flag_value or env.get(ENV_PREFIX + "CONFIG")
    if path is None and Path("config.yaml").is_file():
        path = "config.yaml"
    return path


def layered_values(
    path: str | None, env: Mapping[str, str], args: argparse.Namespace | None = None
) -> dict[str, tuple[Any, str]]:
    """Every key set in the file, env or flags: its type-checked value and its source.

    Later layers overwrite earlier ones (file < env < flag); keys set nowhere are absent,
    so the dataclass defaults apply. `--help` shows these values as the effective defaults.
    """
    values: dict[str, tuple[Any, str]] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        values.update((k, (v, path)) for k, v in _flatten_yaml(data, "", path).items())
    for ck in CONFIG_KEYS:
        if ck.env in env:
            values[ck.key] = (_parse_scalar(env[ck.env], ck.type), ck.env)
        flag_value = getattr(args, dest(ck), None)
        if flag_value is not None:
            parsed = (
                flag_value if isinstance(flag_value, bool) else _parse_scalar(flag_value, ck.type)
            )
            values[ck.key] = (parsed, ck.flag)
    by_key = {ck.key: ck for ck in CONFIG_KEYS}
    return {key: (_check_type(v, by_key[key], src), src) for key, (v, src) in values.items()}


def dest(ck: ConfigKey) -> str:
    """The argparse attribute a key's flag is stored under."""
    return ck.key.replace(".", "__")


def load_settings(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Merge defaults < config.yaml < DELTASERVE_* env < flags into frozen Settings."""
    env = os.environ if env is None else env
    path = config_path(getattr(args, "config", None), env)
    values = layered_values(path, env, args)
    return _build(Settings, {key: value for key, (value, _) in values.items()}, "")
