"""``speculative_config``: vLLM's JSON spelling of speculative decoding, checked and completed."""

from __future__ import annotations

import json
from typing import Any

from cluster.config.choices import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS


def parse_speculative_config(text: str) -> dict[str, Any]:
    """``speculative_config``'s JSON checked and completed: method ngram or draft_model, num_speculative_tokens in
    [1, MAX_SPECULATIVE_TOKENS]; ngram: 1 <= prompt_lookup_min <= prompt_lookup_max (one given: the other equals
    it; neither: 5, vLLM's rule); draft_model: ``model``, the draft's hub id or directory. A ValueError names the
    key and the value."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config={text!r} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config={text!r} must be a JSON object")
    method = spec.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config method={method!r} is not supported: the methods are {SPECULATIVE_METHODS}"
        )
    known = ("method", "num_speculative_tokens") + (
        ("model",) if method == "draft_model" else ("prompt_lookup_min", "prompt_lookup_max")
    )
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}: method {method}'s keys are {list(known)}")
    k = spec.get("num_speculative_tokens")
    if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config num_speculative_tokens={k!r} is invalid: must be an integer in "
            f"[1, {MAX_SPECULATIVE_TOKENS}]"
        )
    if method == "draft_model":
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config model={model!r} is invalid: draft_model needs the draft's id or path")
        return {"method": method, "model": model, "num_speculative_tokens": k}
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    low, high = (low or high or 5), (high or low or 5)
    for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if type(n) is not int or not 1 <= n <= 64:
            raise ValueError(f"speculative_config {name}={n!r} is invalid: must be an integer in [1, 64]")
    if low > high:
        raise ValueError(f"speculative_config prompt_lookup_min={low} is above prompt_lookup_max={high}")
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
