"""Prefill/decode disaggregation's serving side: a live `pd` app (one start for the module, the default model) whose
greedy completions and chats, streamed and not, with and without a prefix hit on the decode side, equal the unified
engine's (an in-process engine of the same settings) token for token, logprobs and usage included; and PDEngine's
retries against fakes (no Ray)."""

import asyncio
import threading
from collections.abc import Callable

import httpx2 as httpx
import openai
import pytest
from ray import serve

from engine.config import AppArgs, EngineConfig
from engine.network import free_port
from scheduler import (
    EngineRequest,
    KVPart,
    KVTransfer,
    KVTransferError,
    Request,
    RequestOutput,
    SampledLogprobs,
    SamplingParams,
)
from serve.app import APP_NAME
from serve.pd import PDEngine, PrefillUnavailable, splits
from serve.router import HASHES_KWARG
from tests.serve.test_server import serving, wait_metrics

MODEL = "smol"
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20
MAX_TOKENS = 12
TOP = 2  # alternatives per token
TEXT = (
    "The river bends twice before it reaches the old mill, where the water slows and the reeds grow tall. "
    "Children from the village come there in summer to fish, and the miller's dog watches them from the bank. "
)


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_cache_bytes=KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def url(ray_session, default_model_dir):
    args = AppArgs(engine=engine_config(default_model_dir), pd=True, served_model_name=MODEL)
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def unified(default_model_dir):
    """`unified(prompt_ids)` -> (token ids, their logprobs, top alternatives, cached prompt tokens) of the greedy
    completion by an in-process engine of the server's settings, which keeps its prefix cache between calls as the
    server's decode engine does."""
    from engine.inprocess import InProcessEngine

    engine = InProcessEngine(engine_config(default_model_dir))
    calls = iter(range(1_000_000))

    def run(prompt_ids: list[int]) -> tuple[list[int], list[float], list[list[float]], int]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
        outs = engine.add_request(
            EngineRequest(request_id=f"ref-{next(calls)}", prompt_token_ids=prompt_ids, sampling_params=params)
        )
        while not any(o.finished for o in outs):
            outs += engine.step()
        logprobs = [lp for o in outs for lp in o.new_logprobs or []]
        tokens = [t for o in outs for t in o.new_token_ids]
        return tokens, [lp.logprob for lp in logprobs], [lp.top_logprobs for lp in logprobs], outs[-1].num_cached_tokens

    return run


def prompt_ids(url: str, prompt: str | list[dict]) -> list[int]:
    body = {"model": MODEL, "messages": prompt} if isinstance(prompt, list) else {"model": MODEL, "prompt": prompt}
    return httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]


@pytest.fixture(scope="module")
def prefilled_prompts(url) -> Callable[[], int]:
    """`prefilled_prompts()` -> the prompt tokens the PrefillServer's engine has looked up in its prefix cache (one
    lookup per prompt it computed). A handle in this process routes on the loop it was made on (ingress.py's
    settings), which must run until Serve's shutdown closes the handle: a daemon thread's."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def ask() -> int:
        handle = serve.get_deployment_handle("PrefillServer", app_name=APP_NAME)
        return (await handle.stats.remote()).prefix_cache_queries

    return lambda: asyncio.run_coroutine_threadsafe(ask(), loop).result(60)


def long_text(tag: str) -> str:
    return f"{tag}: " + TEXT * 12  # about 500 tokens: 31 full blocks of 16


def completion(client, prompt: str, stream: bool) -> tuple[str, list[float], list[list[float]], object]:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP)
    if not stream:
        r = client.completions.create(**kw)
        lp = r.choices[0].logprobs
        return (
            r.choices[0].text,
            lp.token_logprobs,
            [sorted(t.values(), reverse=True) for t in lp.top_logprobs],
            r.usage,
        )
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text, logprobs, tops = "", [], []
    for c in chunks:
        for choice in c.choices:
            text += choice.text
            if choice.logprobs is not None:
                logprobs += choice.logprobs.token_logprobs
                tops += [sorted(t.values(), reverse=True) for t in choice.logprobs.top_logprobs]
    return text, logprobs, tops, chunks[-1].usage


def chat(client, messages: list[dict], stream: bool) -> tuple[str, list[float], list[list[float]], object]:
    kw = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP)
    if not stream:
        r = client.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        return r.choices[0].message.content, *logprob_lists(content), r.usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    content = [c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    return text, *logprob_lists(content), chunks[-1].usage


def logprob_lists(content) -> tuple[list[float], list[list[float]]]:
    return [c.logprob for c in content], [[t.logprob for t in c.top_logprobs] for c in content]


def assert_unified(got, expected, tokenizer_text: str) -> None:
    text, logprobs, tops, usage = got
    tokens, ref_logprobs, ref_tops, cached = expected
    assert text == tokenizer_text
    # Equal here to the last bit; the margin is for a machine where the two processes' thread counts would sum the
    # same products in another order. A block moved wrong changes them by far more.
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-6)
    assert [t[:TOP] for t in tops] == [pytest.approx(t, abs=1e-6) for t in ref_tops]
    assert usage.completion_tokens == len(tokens)
    assert usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completion_through_pd_is_the_unified_engines_without_and_with_a_prefix_hit(
    url, client, unified, stream, default_model_dir, prefilled_prompts
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = long_text(f"completion {stream}")
    ids = prompt_ids(url, prompt)
    before = prefilled_prompts()
    for attempt in ("no hit", "hit"):  # the second time, the decode engine's prefix cache holds the prompt
        expected = unified(ids)
        got = completion(client, prompt, stream)
        assert_unified(got, expected, tokenizer.decode(expected[0]))
        assert got[3].prompt_tokens == len(ids)
        assert (expected[3] > 0) == (attempt == "hit")
    assert prefilled_prompts() == before + 2 * len(ids)  # both ran their prompt on the prefill replica


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_through_pd_is_the_unified_engines_without_and_with_a_prefix_hit(
    url, client, unified, stream, default_model_dir
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": long_text(f"chat {stream}") + " Say what the dog does."}]
    ids = prompt_ids(url, messages)
    for _ in range(2):
        expected = unified(ids)
        got = chat(client, messages, stream)
        assert_unified(got, expected, tokenizer.decode(expected[0], skip_special_tokens=True))


def test_requests_of_several_samples_or_one_token_skip_the_prefill_replica(client, prefilled_prompts):
    before = prefilled_prompts()
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0, n=2)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.choices[0].text == r.choices[1].text
    assert prefilled_prompts() == before


def test_the_prefill_replica_exports_its_engines_series_under_its_own_label(url, client, prefilled_prompts):
    """/metrics carries the prefill replica's engine series beside the decode replica's: a replica whose
    prefix-cache queries are the prompts the prefill engine computed, with its own KV-cache gauge."""
    client.completions.create(model=MODEL, prompt=long_text("metrics"), max_tokens=2, temperature=0)
    queried = prefilled_prompts()
    assert queried > 0

    def queries(samples: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in samples.items() if k.startswith("vllm:prefix_cache_queries_total{")}

    samples = wait_metrics(url, lambda m: len(queries(m)) >= 2 and queried in queries(m).values(), by_replica=True)
    replicas = [k.rpartition("replica=")[2].rstrip("}") for k, v in queries(samples).items() if v == queried]
    gauges = [k for k in samples if k.startswith("vllm:kv_cache_usage_perc{")]
    assert any(f"replica={r}" in k for r in replicas for k in gauges), samples


def test_health_is_200_while_the_decode_and_a_prefill_replica_serve(url):
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200


# ---- PDEngine against fakes: its retries, without Ray ----


def delta(tokens: list[int], finish_reason: str | None = None, **kw) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        index=0,
        new_token_ids=tokens,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        new_logprobs=[SampledLogprobs(logprob=-0.5, top_token_ids=[], top_logprobs=[])],
        **kw,
    )


class FakeResponse:
    def __init__(self, result) -> None:
        self.result = result

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def cancel(self) -> None:
        pass


class FakePrefill:
    """A prefill deployment's handle whose calls answer ``results`` in turn, recording the requests."""

    def __init__(self, *results) -> None:
        self.results = list(results)
        self.requests: list[EngineRequest] = []
        self.kwargs: list[dict] = []
        self.prefill = self

    def remote(self, request: EngineRequest, **kwargs) -> FakeResponse:
        self.requests.append(request)
        self.kwargs.append(kwargs)
        return FakeResponse(self.results.pop(0))


class FakeDecode:
    """A decode engine (an EngineClient): ``prefix_hit_blocks`` answers ``hit``; each ``generate`` raises the next of
    ``failures`` (before any delta) or streams two tokens, recording the requests."""

    class config:
        block_size = 16

    def __init__(self, hit: int, *failures: BaseException) -> None:
        self.hit = hit
        self.failures = list(failures)
        self.requests: list[EngineRequest] = []

    async def prefix_hit_blocks(self, request: EngineRequest) -> int:
        return self.hit

    def check_request(self, request: EngineRequest) -> EngineRequest:
        return request  # it runs no model: any request will do

    def generate(self, request: EngineRequest):
        self.requests.append(request)
        return self._stream()

    async def _stream(self):
        if self.failures:
            raise self.failures.pop(0)
        yield delta([8])
        yield delta([9], "length", num_cached_tokens=32)


def transfer(token: int) -> KVTransfer:
    return KVTransfer(
        first_block=2,
        num_prompt_tokens=40,
        block_size=16,
        parts=[KVPart(head_start=0, num_heads=1, data=token)],
        token_ids=[token],
    )


def run_pd(decode: FakeDecode, prefill: FakePrefill) -> list[RequestOutput]:
    request = EngineRequest(
        request_id="r",
        prompt_token_ids=list(range(40)),
        sampling_params=SamplingParams(max_tokens=3, prompt_logprobs=1),
    )
    assert splits(request)

    async def collect():
        return [out async for out in PDEngine(decode, prefill).generate(request)]

    return asyncio.run(collect())


def test_pd_streams_the_prefilled_token_then_the_decode_engines():
    decode, prefill = FakeDecode(hit=2), FakePrefill(delta([7], "length", kv_transfer=transfer(7)))
    outs = run_pd(decode, prefill)
    assert [o.new_token_ids for o in outs] == [[7], [8], [9]]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[0].kv_transfer is None
    sent = prefill.requests[0]
    assert (sent.sampling_params.max_tokens, sent.kv_export_from_block) == (1, 2)
    # The prompt's full blocks' hashes, for the prefill deployment's prefix-cache router (router.py).
    assert prefill.kwargs == [{HASHES_KWARG: Request(sent, block_size=16).block_hashes}]
    assert len(prefill.kwargs[0][HASHES_KWARG]) == 2
    assert decode.requests[0].kv_transfer.token_ids == [7]
    assert decode.requests[0].sampling_params.prompt_logprobs is None  # they came with the prefilled token


def test_pd_answers_a_prompt_that_stops_at_its_first_token_from_the_prefill_alone():
    decode, prefill = FakeDecode(hit=2), FakePrefill(delta([0], "stop", kv_transfer=transfer(0), num_cached_tokens=0))
    outs = run_pd(decode, prefill)
    assert [(o.new_token_ids, o.finish_reason, o.num_cached_tokens) for o in outs] == [([0], "stop", 32)]
    assert decode.requests == []


def test_pd_retries_a_failed_prefill_once_then_fails_saying_so():
    decode = FakeDecode(hit=0)
    prefill = FakePrefill(RuntimeError("replica died"), delta([7], "length", kv_transfer=transfer(7)))
    assert [o.new_token_ids for o in run_pd(decode, prefill)] == [[7], [8], [9]]
    assert [r.request_id for r in prefill.requests] == ["r-prefill1", "r-prefill2"]
    with pytest.raises(PrefillUnavailable, match="tried twice.*gone again"):
        run_pd(FakeDecode(hit=0), FakePrefill(RuntimeError("gone"), RuntimeError("gone again")))


def test_pd_retries_a_lost_kv_transfer_on_a_new_prefill_keeping_the_token_it_streamed():
    decode = FakeDecode(0, KVTransferError("the part is lost"))
    prefill = FakePrefill(delta([7], "length", kv_transfer=transfer(7)), delta([5], "length", kv_transfer=transfer(5)))
    outs = run_pd(decode, prefill)
    assert [o.new_token_ids for o in outs] == [[7], [8], [9]]  # 7 streamed once
    retried = decode.requests[1].kv_transfer
    assert (retried.parts[0].data, retried.token_ids) == (5, [7])  # the new KV, the token already streamed
    decode = FakeDecode(0, KVTransferError("lost"), KVTransferError("lost again"))
    prefill = FakePrefill(*[delta([7], "length", kv_transfer=transfer(7))] * 2)
    with pytest.raises(PrefillUnavailable, match="lost again"):
        run_pd(decode, prefill)
    decode = FakeDecode(0, KVTransferError("lost"))
    prefill = FakePrefill(delta([7], "length", kv_transfer=transfer(7)), delta([], "error", error="step failed"))
    with pytest.raises(PrefillUnavailable, match=r"KV was lost \(lost\), and its prefill again: step failed"):
        run_pd(decode, prefill)


@pytest.mark.parametrize(
    "params, lora",
    [
        (SamplingParams(n=2, max_tokens=4), None),
        (SamplingParams(max_tokens=1), None),
        (SamplingParams(max_tokens=1, pooling="last"), None),
        (SamplingParams(max_tokens=4), "adapter"),
    ],
    ids=["n=2", "max_tokens=1", "embedding", "lora"],
)
def test_pd_runs_what_it_does_not_split_whole_on_the_decode_engine(params, lora):
    decode = FakeDecode(0)
    request = EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=params, lora_name=lora)
    assert not splits(request)
    PDEngine(decode, FakePrefill()).generate(request)
    assert decode.requests == [request]


def test_pd_health_names_a_prefill_deployment_that_does_not_answer():
    class Handle:
        class ready:
            @staticmethod
            def remote():
                return FakeResponse(RuntimeError("engine down"))

    with pytest.raises(RuntimeError, match="no prefill replica serves: RuntimeError: engine down"):
        asyncio.run(PDEngine(FakeDecode(0), Handle()).check_prefill())
