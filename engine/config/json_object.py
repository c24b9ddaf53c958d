"""The settings that take a JSON object as vLLM spells them (speculative_config, kv_events_config): parsed here."""

from __future__ import annotations

import json
from typing import Any


def json_object(field: str, text: str) -> dict[str, Any]:
    """``text`` as a JSON object; a ValueError names ``field`` and the text when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}={text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}={text!r} must be a JSON object")
    return value
