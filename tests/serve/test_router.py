"""The prefix-cache router's decisions, without Serve: the choice from hits and loads, the memory of recent
routes, and the block hashes of a request body (the scheduler's own chain)."""

import json
import random

import pytest
from transformers import AutoTokenizer

from scheduler.request import EngineRequest, Request
from serve.router import (
    MIN_HIT_BLOCKS,
    OVERLOAD_FACTOR,
    RecentRoutes,
    _hit,
    choose,
    request_block_hashes,
)


def test_the_longest_hit_wins_and_ties_go_to_the_least_loaded():
    rng = random.Random(0)
    assert choose([0, 5, 3], [1, 3, 1], 2, rng) == 1
    assert choose([5, 5, 3], [4, 1, 0], 2, rng) == 1


def test_an_overloaded_best_falls_back_to_the_less_loaded_of_two():
    rng = random.Random(0)
    limit = int(OVERLOAD_FACTOR * 1 + 4)
    assert choose([9, 0], [limit, 1], 4, rng) == 0  # at the bound: still the hit
    assert choose([9, 0], [limit + 1, 1], 4, rng) == 1


def test_no_useful_hit_is_power_of_two_by_load():
    assert MIN_HIT_BLOCKS >= 1
    picks = {choose([0, 0, 0], [5, 0, 5], 2, random.Random(seed)) for seed in range(50)}
    assert 1 in picks and picks <= {0, 1, 2}
    # of any two drawn, the less loaded: the busiest of three is never picked
    assert 2 not in {choose([0, 0, 0], [0, 1, 9], 2, random.Random(seed)) for seed in range(50)}


def test_recent_routes_count_hashes_and_load_until_forgotten():
    recent = RecentRoutes()
    recent.add(1.0, [b"a", b"b"])
    recent.add(2.0, [b"a"])
    assert _hit([b"a", b"b", b"c"], frozenset(), recent.counts) == 2
    assert _hit([b"x", b"a"], frozenset({b"x"}), recent.counts) == 2
    assert recent.num_after(0.5) == 2 and recent.num_after(1.5) == 1 and recent.num_after(2.0) == 0
    recent.forget_before(1.5)
    assert _hit([b"a", b"b"], frozenset(), recent.counts) == 1
    recent.forget_before(3.0)
    assert not recent.counts and _hit([b"a"], frozenset(), recent.counts) == 0


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_body_hashes_are_the_schedulers_including_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "You answer in French. " * 20}, {"role": "user", "content": "Hi"}]
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    hashes = request_block_hashes(tokenizer, body, 16)
    assert len(hashes) == len(ids) // 16 > 4
    assert hashes == Request(EngineRequest(request_id="r", prompt_token_ids=list(ids)), block_size=16).block_hashes
    prompt = {"prompt": "Count: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"}
    assert (
        request_block_hashes(tokenizer, json.dumps(prompt).encode(), 16)
        == Request(
            EngineRequest(request_id="r", prompt_token_ids=tokenizer.encode(prompt["prompt"])), block_size=16
        ).block_hashes
    )
    # A model other than the base names a LoRA adapter: its blocks are the adapter's, as the scheduler keys them.
    under = request_block_hashes(tokenizer, json.dumps({**prompt, "model": "sql"}).encode(), 16, "base")
    assert (
        under
        == Request(
            EngineRequest(request_id="r", prompt_token_ids=tokenizer.encode(prompt["prompt"]), lora_name="sql"),
            block_size=16,
        ).block_hashes
    )
    assert not set(under) & set(
        request_block_hashes(tokenizer, json.dumps({**prompt, "model": "base"}).encode(), 16, "base")
    )


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        json.dumps({"prompt": "hi", "bogus": 1}).encode(),
        json.dumps({"prompt": ["a", "b"]}).encode(),
        json.dumps({"messages": [{"role": "nobody", "content": "x"}]}).encode(),
        json.dumps({"prompt": [-1, 5]}).encode(),
    ],
    ids=["not-json", "not-object", "unknown-field", "two-prompts", "bad-role", "bad-ids"],
)
def test_a_body_it_cannot_hash_is_routed_by_load(tokenizer, body):
    assert request_block_hashes(tokenizer, body, 16) == []
