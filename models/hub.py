"""Find a checkpoint directory: a local path, or a Hugging Face Hub id to download.

Only what serving needs is fetched (configs, safetensors, tokenizer and chat-template
files), so the hub's original .bin/.pth duplicates and images are never downloaded.
"""

from __future__ import annotations

from pathlib import Path

# Everything a checkpoint directory needs for serving; weights only as safetensors.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.tiktoken", "tokenizer*"]


class CheckpointNotFoundError(FileNotFoundError):
    """The path does not exist and the hub id could not be found or downloaded."""


def _looks_like_path(path_or_id: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else is meant as a filesystem path."""
    return path_or_id.startswith(("/", ".", "~")) or path_or_id.count("/") > 1


def resolve_checkpoint(path_or_id: str, revision: str | None = None) -> Path:
    """The local directory of a checkpoint, downloading hub ids into the HF cache.

    A local directory wins. A hub id is fetched with `huggingface_hub.snapshot_download`
    (honouring HF_HUB_OFFLINE and HF_HOME); failures raise CheckpointNotFoundError naming
    the path or id and the reason.
    """
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointNotFoundError(f"{path_or_id} is a file; expected a checkpoint directory")
    if _looks_like_path(path_or_id):
        raise CheckpointNotFoundError(f"checkpoint directory {path_or_id} does not exist")
    return _download(path_or_id, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except HFValidationError as err:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is neither a local directory nor a valid Hugging Face Hub id"
        ) from err
    except Exception as err:  # offline, unknown repo, gated, network: one clear message
        raise CheckpointNotFoundError(
            f"checkpoint {repo_id!r} is not a local directory and could not be fetched "
            f"from the Hugging Face Hub ({type(err).__name__}: {err})"
        ) from err
