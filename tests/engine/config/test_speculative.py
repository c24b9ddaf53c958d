"""``speculative_config`` as vLLM's documentation spells it: the method inferred where vLLM infers it, each key vLLM
documents either honoured or refused by name."""

import json

import pytest

from engine.config import parse_speculative_config
from engine.config.speculative import VLLM_ONLY_KEYS


def parse(spec: dict) -> dict:
    return parse_speculative_config(json.dumps(spec))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # a draft model without a method: vLLM takes it as draft_model
        (
            {"model": "facebook/opt-125m", "num_speculative_tokens": 5},
            {"method": "draft_model", "model": "facebook/opt-125m", "num_speculative_tokens": 5},
        ),
        (
            {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 3},
            {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 3},
        ),
        # the values raylm's draft runs with anyway
        (
            {
                "model": "d",
                "num_speculative_tokens": 2,
                "draft_tensor_parallel_size": 1,
                "draft_sample_method": "greedy",
            },
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 2},
        ),
        # n-gram lookup named by its model, in both of vLLM's spellings, and by its method
        (
            {"model": "ngram", "num_speculative_tokens": 3},
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 5},
        ),
        (
            {"model": "[ngram]", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 4, "prompt_lookup_max": 4},
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        ),
        (
            {"method": "[ngram]", "model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3},
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 3},
        ),
    ],
    ids=["draft-no-method", "draft", "draft-fixed-keys", "ngram-model", "ngram-bracketed", "ngram", "ngram-both"],
)
def test_vllms_spellings_are_served(spec, expected):
    assert parse(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # vLLM's EAGLE example, and the same head with its method left to be inferred from its name
        (
            {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2},
            r"method='eagle' is not supported",
        ),
        (
            {"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2},
            r"method='eagle' \(inferred from model='yuhuili/EAGLE-LLaMA3-Instruct-8B'",
        ),
        ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2}, "method='eagle3'"),
        ({"model": "my_pkg.MyProposer", "num_speculative_tokens": 2}, "method='custom_class'"),
        ({"method": "mtp", "num_speculative_tokens": 1}, "method='mtp'"),
        ({"method": "suffix", "num_speculative_tokens": 32}, "method='suffix'"),
        ({"num_speculative_tokens": 3}, "model=None is invalid"),
        # vLLM's keys raylm has no use for, and fixed keys at another value
        ({"model": "d", "num_speculative_tokens": 2, "revision": "main"}, r"\['revision'\] are vLLM's"),
        ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2"),
        ({"model": "d", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"model": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
        ({"model": "d", "num_speculative_tokens": 2, "bogus": 1}, r"unknown keys \['bogus'\]"),
        ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "takes no draft model"),
    ],
)
def test_what_raylm_cannot_serve_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        parse(spec)


@pytest.mark.parametrize("key", VLLM_ONLY_KEYS)
def test_every_vllm_key_raylm_does_not_support_is_named(key):
    with pytest.raises(ValueError, match=rf"\['{key}'\] are vLLM's"):
        parse({"model": "d", "num_speculative_tokens": 2, key: None})
