"""A model named by a Hugging Face id, found in (or fetched into) the standard hub cache of this node.

huggingface_hub reads HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE itself: with HF_HUB_OFFLINE=1 a model
must already be cached. Only the files raylm loads are fetched: configs, safetensors shards and their index, and
the tokenizer's files, never a repository's other weights (.bin, .pt, .gguf, onnx) or its media.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = [pattern for pattern in MODEL_FILES if pattern != "*.safetensors"]
# The hub's repository names: an owner and a name of letters, digits, '-', '_' and '.'.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model that is neither a local directory nor found in (or fetchable into) the hub cache: a missing file
    to the shell, a bad argument to the API (LLM(model=...) raises ValueError for every bad setting)."""


def hub_cache(download_dir: str | None) -> str:
    from huggingface_hub import constants

    return download_dir or constants.HF_HUB_CACHE


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None, weights: bool = True) -> str:
    """The local directory holding model `name`: `name` itself when it is a directory, else the hub snapshot of
    repository `name` at `revision`. ModelNotFoundError names the id and the cache when neither is there."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if not REPO_ID.match(name) or name.startswith((".", "~")):
        raise ModelNotFoundError(
            f"model {name!r} does not exist: no such directory, and not a Hugging Face id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"{name!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(
            name, revision=revision, cache_dir=download_dir, allow_patterns=MODEL_FILES if weights else TOKENIZER_FILES
        )
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"model {where} is not in the Hugging Face cache at {hub_cache(download_dir)} and "
            f"cannot be fetched ({_first_line(e)})"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {where}: no such repository on the Hugging Face hub (or it is private or gated: set HF_TOKEN)"
        ) from None
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"model {where} could not be fetched: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
