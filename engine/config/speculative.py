"""``speculative_config``: vLLM's JSON spelling of speculative decoding, checked and completed."""

from __future__ import annotations

from typing import Any

from engine.config.choices import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from engine.config.json_object import json_object

# What each method reads; the other keys vLLM documents are refused by name below.
METHOD_KEYS = {
    "ngram": ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "draft_sample_method"),
}
# vLLM's keys whose only value raylm can honour is what its draft does anyway: it runs on the first rank alone and
# proposes its argmax (workers/draft.py).
FIXED = {"draft_tensor_parallel_size": 1, "draft_sample_method": "greedy"}
VLLM_ONLY_KEYS = (
    "enforce_eager",
    "tensor_parallel_size",
    "quantization",
    "moe_backend",
    "attention_backend",
    "kv_cache_dtype",
    "max_model_len",
    "revision",
    "code_revision",
    "index_share_for_mtp_iteration",
    "disable_padded_drafter_batch",
    "disable_eagle_block_drop",
    "use_local_argmax_reduction",
    "use_heterogeneous_vocab",
    "parallel_drafting",
    "num_speculative_tokens_per_batch_size",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "draft_load_config",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
    "enable_adaptive_verification",
    "dspark_draft_topk",
)
# A draft whose name says it is a head of another kind, as vLLM reads the name when no method is given.
NAMED_HEADS = (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"))


def infer_method(spec: dict[str, Any]) -> Any:
    """The method, as vLLM infers it when none is given: from ``model``, "ngram" for ``"ngram"`` (or
    ``"[ngram]"``), a custom proposer for a dotted import path, a head kind its name spells, else draft_model."""
    method, model = spec.get("method"), spec.get("model")
    if method == "[ngram]":
        return "ngram"
    if method is not None:
        return method
    if not isinstance(model, str):
        return "draft_model"
    if model in ("ngram", "[ngram]"):
        return "ngram"
    parts = model.split(".")
    if "/" not in model and len(parts) >= 2 and all(p.isidentifier() for p in parts):
        return "custom_class"
    return next((kind for mark, kind in NAMED_HEADS if mark in model.lower()), "draft_model")


def parse_speculative_config(text: str) -> dict[str, Any]:
    """``speculative_config``'s JSON checked and completed: method ngram or draft_model (when absent, inferred from
    ``model`` as vLLM infers it), num_speculative_tokens in [1, MAX_SPECULATIVE_TOKENS]; ngram: 1 <=
    prompt_lookup_min <= prompt_lookup_max (one given: the other equals it; neither: 5, vLLM's rule); draft_model:
    ``model``, the draft's hub id or directory. A key vLLM documents that raylm cannot honour is refused naming it;
    a ValueError names the key and the value."""
    spec = json_object("speculative_config", text)
    method = infer_method(spec)
    if method not in SPECULATIVE_METHODS:
        how = "" if "method" in spec else f" (inferred from model={spec.get('model')!r}, as vLLM infers it)"
        raise ValueError(
            f"speculative_config method={method!r}{how} is not supported: the methods are {SPECULATIVE_METHODS}"
        )
    check_keys(spec, method)
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
    if spec.get("model", "ngram") not in ("ngram", "[ngram]"):
        raise ValueError(f"speculative_config model={spec['model']!r} is invalid: method ngram takes no draft model")
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    low, high = (low or high or 5), (high or low or 5)
    for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if type(n) is not int or not 1 <= n <= 64:
            raise ValueError(f"speculative_config {name}={n!r} is invalid: must be an integer in [1, 64]")
    if low > high:
        raise ValueError(f"speculative_config prompt_lookup_min={low} is above prompt_lookup_max={high}")
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}


def check_keys(spec: dict[str, Any], method: str) -> None:
    """Refuse, by name, a key of vLLM's that raylm does not honour, a fixed key's other value, and any key that is
    neither vLLM's nor ``method``'s."""
    vllm_only = sorted(set(spec) & set(VLLM_ONLY_KEYS))
    if vllm_only:
        raise ValueError(f"speculative_config keys {vllm_only} are vLLM's, but raylm does not support them")
    for key, value in FIXED.items():
        if key in spec and spec[key] != value:
            raise ValueError(
                f"speculative_config {key}={spec[key]!r} is not supported: raylm's draft runs with {key}={value!r}"
            )
    known = METHOD_KEYS[method]
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(
            f"speculative_config has unknown keys {unknown} for method {method}: its keys are {list(known)}"
        )
