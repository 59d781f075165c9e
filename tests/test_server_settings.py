"""Settings: precedence (flag > env > config.yaml > defaults), generated flags, errors that
name the key, and config.yaml's commented defaults staying in sync with the code."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.server.cli import build_parser
from deltaserve.server.flags import add_arguments
from deltaserve.server.settings import (
    CONFIG_KEYS,
    ConfigError,
    ServerSettings,
    Settings,
    load_settings,
)

REPO = Path(__file__).resolve().parent.parent


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def write_config(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_without_any_source(tmp_path: Path) -> None:
    """No file, no env, no flags: the dataclass defaults (engine section = EngineConfig())."""
    settings = load_settings(parse("--config", write_config(tmp_path, {})), env={})
    assert settings == Settings()
    assert isinstance(settings.engine, EngineConfig) and settings.engine == EngineConfig()


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    """Each layer overrides the one below it, key by key."""
    path = write_config(
        tmp_path,
        {
            "engine": {
                "max_num_seqs": 8,
                "max_waiting": 9,
                "kv_cache": {"bits": 4, "kind": "affine"},
            },
            "server": {"port": 1111},
        },
    )
    env = {"DELTASERVE_MAX_NUM_SEQS": "16", "DELTASERVE_PORT": "2222", "DELTASERVE_CONFIG": "x"}
    settings = load_settings(parse("--config", path, "--max-num-seqs", "64"), env=env)
    assert settings.engine.max_num_seqs == 64  # flag
    assert settings.server.port == 2222  # env over file
    assert settings.engine.max_waiting == 9  # file over default
    assert settings.engine.kv_cache == KVCacheConfig(kind="affine", bits=4)
    assert settings.engine.max_prefill_chunk == EngineConfig().max_prefill_chunk  # default


def test_config_path_from_env(tmp_path: Path) -> None:
    """$DELTASERVE_CONFIG names the file when --config is absent."""
    path = write_config(tmp_path, {"model": {"path": "some/model", "served_name": "m"}})
    settings = load_settings(parse(), env={"DELTASERVE_CONFIG": path})
    assert settings.model.name == "m" and settings.model.path == "some/model"


def test_every_key_has_a_flag_and_env_var() -> None:
    """Flags are generated from the fields; the ones operators reach for exist."""
    flags = {key.flag for key in CONFIG_KEYS}
    for flag in (
        "--max-num-seqs",
        "--kv-cache",
        "--kv-bits",
        "--kv-group-size",
        "--kv-start",
        "--kv-key-bits",
        "--kv-value-bits",
        "--api-key",
        "--model",
        "--host",
        "--port",
    ):
        assert flag in flags
    assert all(
        key.env == "DELTASERVE_" + key.flag[2:].upper().replace("-", "_") for key in CONFIG_KEYS
    )
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-cache",
            "turboquant",
            "--kv-value-bits",
            "4",
            "--cors-origins",
            "a,b",
            "--no-pack-token-wise",
        ]
    )
    settings = load_settings(args, env={"DELTASERVE_CONFIG": "/dev/null"})  # an empty file
    assert (
        settings.engine.kv_cache.kind == "turboquant" and settings.engine.kv_cache.value_bits == 4
    )
    assert settings.server.cors_origins == ("a", "b") and settings.engine.pack_token_wise is False


@pytest.mark.parametrize(
    ("flags", "env", "data", "expected"),
    [
        (("--port", "eighty"), {}, {}, r"server\.port: expected int, got 'eighty' \(from --port\)"),
        ((), {"DELTASERVE_KV_BITS": "many"}, {}, r"engine\.kv_cache\.bits: .*DELTASERVE_KV_BITS"),
        ((), {}, {"engine": {"max_num_seq": 3}}, r"unknown config key 'engine\.max_num_seq'"),
        ((), {}, {"engine": {"max_num_seqs": 0}}, r"max_num_seqs must be >= 1"),
        ((), {}, {"engine": {"max_num_seqs": True}}, r"engine\.max_num_seqs: expected int"),
        ((), {}, {"sampling": {"top_p": 0}}, r"sampling\.top_p"),
        (("--kv-cache", "affine", "--kv-bits", "3"), {}, {}, r"kv_cache\.bits must be 4 or 8"),
        (("--log-level", "loud"), {}, {}, r"server\.log_level"),
        ((), {}, {"server": "oops"}, r"server: expected a mapping"),
    ],
    ids=[
        "flag-type",
        "env-type",
        "unknown-key",
        "engine-check",
        "bool-is-not-int",
        "sampling-range",
        "kv-bits",
        "log-level",
        "section-type",
    ],
)
def test_errors_name_the_key(
    tmp_path: Path, flags: tuple, env: dict, data: dict, expected: str
) -> None:
    """Bad values raise ConfigError naming the key (and where the value came from)."""
    with pytest.raises(ConfigError, match=expected):
        load_settings(parse("--config", write_config(tmp_path, data), *flags), env=env)


def test_repo_config_yaml_loads_and_comments_match_defaults(tmp_path: Path) -> None:
    """config.yaml is valid, and every commented-out `key: value` equals the built-in
    default (so uncommenting a line never changes behaviour by surprise)."""
    text = (REPO / "config.yaml").read_text()
    load_settings(parse("--config", str(REPO / "config.yaml")), env={})
    line = re.compile(r"^(\s*)# (\w+:.*?)(\s+# .*)?$")
    commented = [
        m for m in map(line.match, text.splitlines()) if m and m.group(2).split(":")[1].strip()
    ]
    uncommented = "\n".join(
        m.group(1) + m.group(2) if (m := line.match(row)) else row for row in text.splitlines()
    )
    assert len(commented) >= 15
    path = tmp_path / "all.yaml"
    path.write_text(uncommented)
    everything = load_settings(parse("--config", str(path)), env={})
    defaults, explicit = Settings(), yaml.safe_load(text)
    for match in commented:
        name = match.group(2).split(":")[0]
        key = next(
            k for k in CONFIG_KEYS if k.key.endswith("." + name) and _commented_in(k.key, explicit)
        )
        assert _get(everything, key.key) == _get(defaults, key.key), key.key


def _commented_in(key: str, explicit: dict) -> bool:
    node: object = explicit
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return True
        node = node[part]
    return False


def _get(settings: Settings, key: str) -> object:
    value: object = settings
    for part in key.split("."):
        value = getattr(value, part)
    return tuple(value) if isinstance(value, list) else value


def test_listed_choices_match_the_dataclass_checks() -> None:
    """--help's choices are exactly what the dataclasses accept (kv kind, bits, group
    size, log level, distributed backend), so the lists in server/settings.py cannot drift."""
    build = {
        "engine.kv_cache.kind": lambda v: KVCacheConfig(kind=v),
        "engine.kv_cache.bits": lambda v: KVCacheConfig(kind="affine", bits=v),
        "engine.kv_cache.group_size": lambda v: KVCacheConfig(group_size=v),
        "server.log_level": lambda v: ServerSettings(log_level=v),
        "engine.distributed_backend": lambda v: EngineConfig(distributed_backend=v),
    }
    outside = {
        "engine.kv_cache.kind": "int4",
        "engine.kv_cache.bits": 6,
        "engine.kv_cache.group_size": 16,
        "server.log_level": "loud",
        "engine.distributed_backend": "carrier-pigeon",
    }
    with_choices = {ck.key: ck.choices for ck in CONFIG_KEYS if ck.choices}
    assert set(with_choices) == set(build)
    for key, choices in with_choices.items():
        for value in choices:
            build[key](value)
        with pytest.raises(ValueError):
            build[key](outside[key])
