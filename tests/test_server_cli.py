"""`deltaserve serve` at the process edge: --help shows effective defaults, choices and
metavars; a missing or unreachable model is one stderr line and exit 2; start-up logs
carry no transformers advice and a kv cache line with only the settings that apply."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deltaserve.engine.config import KVCacheConfig
from deltaserve.server.cli import main
from deltaserve.server.settings import CONFIG_KEYS
from deltaserve.server.startup import kv_cache_summary

REPO = Path(__file__).resolve().parent.parent
NEXT_STEP = "Pass --model /path/to/checkpoint or run scripts/setup for a demo."


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No DELTASERVE_* from the caller's shell leaks into what main() reads."""
    for name in list(os.environ):
        if name.startswith("DELTASERVE_") and "BLAS" not in name:
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at the terminal width


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks


def test_help_shows_config_file_values_as_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key set in the --config file is shown as the flag's default, with its source."""
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({"engine": {"max_num_seqs": 7, "kv_cache": {"bits": 4}}}))
    text = _help(capsys, "--config", str(config))
    assert f"(default: 7 from {config}, built-in 32; env DELTASERVE_MAX_NUM_SEQS)" in text
    assert f"(default: 4 from {config}, built-in 8; env DELTASERVE_KV_BITS)" in text
    assert "(default: 0; env DELTASERVE_MAX_PREFILL_CHUNK)" in text  # not in the file


def test_help_shows_env_over_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$DELTASERVE_* beats the file in --help too, as it does when serving."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": 1111}}))
    monkeypatch.setenv("DELTASERVE_PORT", "2222")
    text = _help(capsys, "--config", str(config))
    assert "--port INT TCP port; 0 = any free port (default: 2222 from DELTASERVE_PORT" in text


def test_help_lists_choices_and_typed_metavars(capsys: pytest.CaptureFixture[str]) -> None:
    """Fixed sets are listed; other flags say what kind of value they take."""
    text = _help(capsys, "--config", "/dev/null")
    assert "--kv-cache {fp,affine,turboquant}" in text
    assert "--log-level {critical,error,warning,info,debug,trace}" in text
    assert "--kv-group-size {32,64,128}" in text
    for usage in ("--model PATH", "--port INT", "--keepalive FLOAT", "--default-top-p FLOAT"):
        assert usage in text
    assert " VALUE " not in text
    assert "--pipeline-steps, --no-pipeline-steps plan step N+1" in text


def test_every_flag_has_a_description() -> None:
    """Each generated flag carries a one-line description from its field."""
    missing = [ck.key for ck in CONFIG_KEYS if not ck.description]
    assert not missing
    assert all("\n" not in ck.description for ck in CONFIG_KEYS)


def test_no_model_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """No --model and none in the config: one actionable line, status 2."""
    assert main(["serve", "--config", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deltaserve: error: no model given")
    assert err.rstrip().endswith(NEXT_STEP)


@pytest.mark.parametrize("kind", ["missing", "file", "empty-dir"])
def test_bad_local_model_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A path that is absent, a file, or a directory without config.json: one line, 2."""
    path = tmp_path / "model"
    if kind == "file":
        path.write_text("not a checkpoint")
    elif kind == "empty-dir":
        path.mkdir()
    assert main(["serve", "--config", "/dev/null", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"deltaserve: error: model '{path}' ")
    assert err.rstrip().endswith(NEXT_STEP)


def test_unreachable_hub_id_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A hub id with the hub unreachable: exactly the documented line, status 2, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    command = [sys.executable, "-m", "deltaserve.server.cli", "serve", "--config", "/dev/null"]
    result = subprocess.run(
        [*command, "--model", "some-org/no-such-model"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "deltaserve: error: model 'some-org/no-such-model' not found: not a local directory "
        f"and the Hugging Face hub is unreachable (offline?). {NEXT_STEP}\n"
    )


# Pretends torch is not installed, as in a server deployment, then imports transformers.
_IMPORT_WITHOUT_TORCH = """
import importlib.util, sys
real_find_spec = importlib.util.find_spec
def find_spec(name, *args, **kwargs):
    return None if name.partition(".")[0] == "torch" else real_find_spec(name, *args, **kwargs)
importlib.util.find_spec = find_spec
from deltaserve.server.cli import quiet_third_party_logs
if sys.argv[1] == "quiet":
    quiet_third_party_logs()
import deltaserve.server.frontend.tokenizer
"""


def test_no_pytorch_advice_at_startup() -> None:
    """transformers' "PyTorch was not found" line is silenced by the CLI (and would show)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}

    def stderr(mode: str) -> str:
        command = [sys.executable, "-c", _IMPORT_WITHOUT_TORCH, mode]
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stderr

    assert "PyTorch was not found" in stderr("loud")  # the check can fail
    assert "PyTorch was not found" not in stderr("quiet")


@pytest.mark.parametrize(
    ("kv", "line"),
    [
        (KVCacheConfig(), "kv cache: fp"),
        (KVCacheConfig(kind="fp", start=16, bits=4), "kv cache: fp"),
        (
            KVCacheConfig(kind="affine", bits=4, group_size=32, start=8),
            "kv cache: affine (4 bits, group size 32, start 8)",
        ),
        (
            KVCacheConfig(kind="turboquant", key_bits=6, value_bits=2, start=4),
            "kv cache: turboquant (key/value bits 6/2, start 4)",
        ),
    ],
    ids=["fp", "fp-ignores-the-rest", "affine", "turboquant"],
)
def test_kv_cache_log_line(kv: KVCacheConfig, line: str) -> None:
    """The kv cache line names only the settings the chosen kind reads."""
    assert kv_cache_summary(kv) == line


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`deltaserve --version` prints the distribution's version and exits 0."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = importlib.metadata.version("deltaserve")
    assert capsys.readouterr().out == f"deltaserve {version}\n"
