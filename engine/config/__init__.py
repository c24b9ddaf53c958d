"""Every setting raylm has, declared once: its type, bounds, default and help.

`EngineConfig` (one engine), `AppArgs` (the Serve app around it) and `LaunchConfig` (where `raylm serve` listens
and which Ray it joins) are the one declaration. The CLI's flags, `--config FILE.yaml`, a Serve config's `args`
and the manifests all derive from these fields (engine/flags.py); the scheduler's and the ranks' configs are
produced from them (derive.py) and carry no defaults or checks of their own. A field's name is vLLM's where vLLM
has the setting, so its flag is vLLM's too; ``flags`` in a field's extra lists other spellings it accepts.
"""

import importlib

from engine.config.app import AppArgs, LaunchConfig, check_served_names, per_model_settings
from engine.config.choices import DEFAULT_MODEL_NAME, GIB, SCHEDULING_POLICIES
from engine.config.engine import EngineConfig, chat_template_text
from engine.config.speculative import parse_speculative_config

# The parts' configs import the parts (workers.worker: torch): loaded when asked for, so that the settings, the
# CLI's parser and `raylm --help` load no model stack.
_DERIVED = ("derive_scheduler_config", "derive_worker_config")

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GIB",
    "SCHEDULING_POLICIES",
    "AppArgs",
    "EngineConfig",
    "LaunchConfig",
    "chat_template_text",
    "check_served_names",
    "derive_scheduler_config",
    "derive_worker_config",
    "parse_speculative_config",
    "per_model_settings",
]


def __getattr__(name: str):
    if name not in _DERIVED:
        raise AttributeError(f"module 'engine.config' has no attribute {name!r}")
    return getattr(importlib.import_module("engine.config.derive"), name)
