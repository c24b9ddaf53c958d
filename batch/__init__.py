"""Offline batch inference on Ray Data (processor.py) and the OpenAI Batch API's file format (openai_file.py)."""

from batch.config import BatchConfig

__all__ = ["BatchConfig", "build_processor"]


def __getattr__(name: str):
    # build_processor is imported on first use: it brings Ray Data and Arrow, which `raylm --help` (importing
    # BatchConfig for its flags) must not wait for.
    if name == "build_processor":
        from batch.processor import build_processor

        return build_processor
    raise AttributeError(f"module 'batch' has no attribute {name!r}")
