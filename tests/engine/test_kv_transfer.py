"""Prefill/decode disaggregation between two in-process engines: a prompt's KV computed by one and decoded by
the other gives the unified engine's greedy tokens and logprobs, moves only the blocks the decode engine lacks,
and leaves no block or staged KV behind."""

import asyncio
import dataclasses

import pytest
import torch

from engine.inprocess import InProcessEngine
from raylm import EngineConfig, SamplingParams
from scheduler import EngineRequest, RequestError, RequestOutput

BLOCK = 8


def engine(path: str, **kw) -> InProcessEngine:
    return InProcessEngine(
        EngineConfig(**{"model": path, "device": "cpu", "block_size": BLOCK, "kv_cache_bytes": 1 << 22, **kw})
    )


def params(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **kw)


def outputs(e: InProcessEngine, request: EngineRequest) -> list[RequestOutput]:
    got = e.add_request(request)
    while e.has_unfinished_requests():
        got += e.step()
    return got


def tokens_and_logprobs(deltas: list[RequestOutput]) -> tuple[list[int], list[float]]:
    return [t for d in deltas for t in d.new_token_ids], [lp.logprob for d in deltas for lp in d.new_logprobs or []]


def disaggregated(prefill: InProcessEngine, decode: InProcessEngine, request: EngineRequest) -> list[RequestOutput]:
    """What the PD ingress does: ask the decode engine what it holds, prefill there with max_tokens 1, decode
    here; the prefill's delta first."""
    first_block = asyncio.run(decode.prefix_hit_blocks(request))
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    (first,) = outputs(prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=first_block))
    assert first.kv_transfer is not None and first.kv_transfer.first_block == first_block
    return [first] + outputs(decode, dataclasses.replace(request, kv_transfer=first.kv_transfer))


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engines(llama):
    return engine(llama), engine(llama), engine(llama)  # unified, prefill, decode


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [5, 16, 37])
def test_prefill_then_decode_gives_the_unified_tokens_and_logprobs(engines, length):
    unified, prefill, decode = engines
    request = EngineRequest(request_id=f"r{length}", prompt_token_ids=prompt(length, length), sampling_params=params())
    expected = tokens_and_logprobs(outputs(unified, request))
    got_tokens, got_logprobs = tokens_and_logprobs(disaggregated(prefill, decode, request))
    assert got_tokens == expected[0] and got_logprobs == pytest.approx(expected[1], abs=1e-5)
    for e in (prefill, decode):
        assert e.scheduler.kv.usage() == 0 and not e.worker.staged_kv


def test_a_seeded_sampled_request_gives_the_unified_tokens(engines):
    """The prefill engine draws the first token from the seed; the decode engine's draws go on from there, not
    from the seed again."""
    unified, prefill, decode = engines
    for i in range(3):
        sampled = SamplingParams(temperature=1.5, seed=100 + i, max_tokens=12, ignore_eos=True)
        request = EngineRequest(request_id=f"s{i}", prompt_token_ids=prompt(9, i), sampling_params=sampled)
        expected, _ = tokens_and_logprobs(outputs(unified, request))
        got, _ = tokens_and_logprobs(disaggregated(prefill, decode, request))
        assert got == expected, f"seed {sampled.seed}"


def test_a_prefix_the_decode_engine_holds_is_not_moved(engines):
    unified, prefill, decode = engines
    shared = prompt(32, 7)
    first = EngineRequest(request_id="a", prompt_token_ids=shared + [5, 6, 7], sampling_params=params())
    second = EngineRequest(request_id="b", prompt_token_ids=shared + [9, 10, 11, 12], sampling_params=params())
    disaggregated(prefill, decode, first)
    assert asyncio.run(decode.prefix_hit_blocks(second)) == 32 // BLOCK
    got = disaggregated(prefill, decode, second)
    transfer = got[0].kv_transfer
    assert transfer.first_block == 4 and transfer.num_blocks == 1  # the 36-token prompt's fifth block only
    assert transfer.parts[0].data.shape[2] == 1
    assert tokens_and_logprobs(got)[0] == tokens_and_logprobs(outputs(unified, second))[0]


def test_a_prefix_evicted_before_admission_is_computed_by_the_decode_engine(engines):
    unified, prefill, decode = engines
    request = EngineRequest(request_id="e", prompt_token_ids=prompt(30, 3), sampling_params=params())
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    # The caller was told 2 blocks were cached here; they are not, so the transfer's blocks 2.. are not enough.
    (first,) = outputs(prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=2))
    got = [first] + outputs(decode, dataclasses.replace(request, kv_transfer=first.kv_transfer))
    assert tokens_and_logprobs(got)[0] == tokens_and_logprobs(outputs(unified, request))[0]
    assert not decode.worker.staged_kv and decode.scheduler.kv.usage() == 0


def test_penalties_count_the_transferred_token_as_an_output(engines):
    unified, prefill, decode = engines
    request = EngineRequest(
        request_id="p", prompt_token_ids=prompt(21, 4), sampling_params=params(12, frequency_penalty=1.5)
    )
    assert (
        tokens_and_logprobs(disaggregated(prefill, decode, request))[0]
        == tokens_and_logprobs(outputs(unified, request))[0]
    )


def test_an_aborted_request_drops_its_staged_kv(engines):
    _, prefill, decode = engines
    request = EngineRequest(request_id="x", prompt_token_ids=prompt(20, 5), sampling_params=params())
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    (first,) = outputs(prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=0))
    decode.add_request(dataclasses.replace(request, kv_transfer=first.kv_transfer))
    assert "x" in decode.worker.staged_kv
    decode.abort("x")
    assert not decode.worker.staged_kv and decode.scheduler.kv.usage() == 0


def test_a_transfer_from_an_engine_of_another_block_size_is_refused_naming_both(engines, llama):
    _, _, decode = engines
    other = engine(llama, block_size=16)
    request = EngineRequest(request_id="s", prompt_token_ids=prompt(20, 6), sampling_params=params())
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    (first,) = outputs(other, dataclasses.replace(request, sampling_params=one, kv_export_from_block=0))
    with pytest.raises(RequestError, match="kv_transfer.block_size=16 is invalid: this engine's blocks hold 8"):
        decode.add_request(dataclasses.replace(request, kv_transfer=first.kv_transfer))
    assert not decode.worker.staged_kv


def test_a_prompt_the_decode_engine_holds_whole_moves_nothing(engines):
    unified, prefill, decode = engines
    request = EngineRequest(request_id="w", prompt_token_ids=prompt(24, 8), sampling_params=params())
    disaggregated(prefill, decode, request)
    got = disaggregated(prefill, decode, request)  # its three blocks are cached here now (the probe sees two)
    assert got[0].kv_transfer.num_blocks == 1
    assert tokens_and_logprobs(got)[0] == tokens_and_logprobs(outputs(unified, request))[0]
    assert not decode.worker.staged_kv and decode.scheduler.kv.usage() == 0
