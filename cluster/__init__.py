"""Assembly: configs, engines, the offline LLM API, the Serve app and the CLI."""

from cluster.config import EngineConfig
from cluster.llm import LLM, Completion, GenerateOutput
from scheduler import SamplingParams

__all__ = ["LLM", "Completion", "EngineConfig", "GenerateOutput", "SamplingParams"]
