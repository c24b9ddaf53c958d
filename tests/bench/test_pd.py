"""`raylm bench pd`'s load, figures and report, without servers: the mixed load against a stub that streams what it
is asked, each run's row from known stream times, the KV a prompt moves, and a bad load refused before any server
starts."""

import asyncio
import json

import pytest
from aiohttp import web

from bench.pd import MixedLoad, MixedTimes, drive, kv_transfer_bytes, mixed_row, print_ratios
from bench.serve import StreamTimes
from cli import main
from engine.network import free_port

VOCAB = 1000


async def stub_server(bodies: list[dict]) -> tuple[web.AppRunner, str]:
    """Streams one chunk of text per token asked, then the usage, as an OpenAI completions server does."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.005)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_the_load_sends_every_long_prompt_beside_back_to_back_decodes():
    load = MixedLoad(
        prompt_len=40, prompt_rate=4.0, prompt_output_len=3, decodes=2, decode_prompt_len=5, decode_len=4, duration_s=1
    )
    bodies: list[dict] = []

    async def run() -> MixedTimes:
        runner, url = await stub_server(bodies)
        try:
            return await drive(url, "m", load, VOCAB)
        finally:
            await runner.cleanup()

    times = asyncio.run(run())
    warm, *sent = bodies
    long = [b for b in sent if len(b["prompt"]) == 40]
    decode = [b for b in sent if len(b["prompt"]) == 5]
    assert len(long) == len(times.long) == load.num_long_prompts == 4
    assert len(decode) == len(times.decode) >= 2 and len(long) + len(decode) == len(sent)
    assert {b["max_tokens"] for b in long} == {3} and {b["max_tokens"] for b in decode} == {4}
    assert all(100 <= t < VOCAB for b in sent for t in b["prompt"]) and all(b["stream"] for b in sent)
    assert len({tuple(b["prompt"]) for b in long}) == 4  # no prefix shared between long prompts
    row = mixed_row("stub", times)
    assert row["completed"] == row["num_requests"] == len(sent) and row["errors"] == []
    assert row["output_throughput"] == (3 * 4 + 4 * len(decode)) / times.seconds


def test_a_row_measures_itl_over_every_stream_and_ttft_per_kind(capsys):
    long = StreamTimes(sent=0.0, chunks=[1.0, 1.5], end=1.5, output_tokens=2)
    decode = StreamTimes(sent=2.0, chunks=[2.1, 2.2, 2.4], end=2.4, output_tokens=3)
    failed = StreamTimes(sent=0.0, end=0.1, error="HTTP 503: no prefill replica")
    row = mixed_row("unified", MixedTimes([long], [decode, failed], seconds=2.5))
    assert (row["completed"], row["num_requests"], row["errors"]) == (2, 3, ["HTTP 503: no prefill replica"])
    assert row["output_throughput"] == 5 / 2.5
    assert row["itl"]["median"] == pytest.approx(200.0)  # gaps 500, 100, 200 ms
    assert row["itl"]["max"] == pytest.approx(500.0)
    assert row["first_gap"]["median"] == pytest.approx(300.0)  # each stream's first: 500, 100 ms
    assert row["ttft_long"]["median"] == pytest.approx(1000.0)
    assert row["ttft_decode"]["median"] == pytest.approx(100.0)
    halved = mixed_row("pd", MixedTimes([long], [decode], seconds=1.25))
    print_ratios(halved, row)
    assert "pd / unified: output tok/s 2.00x; ITL, every stream median 1.00x" in capsys.readouterr().out


def test_a_prompt_moves_every_block_it_touches_whole():
    assert kv_transfer_bytes(1024, 16, 46_080) == 1024 * 46_080  # SmolLM2 in fp32: 45 MiB
    assert kv_transfer_bytes(1025, 16, 10) == 65 * 16 * 10
    assert kv_transfer_bytes(2048, 16, 131_072) == 256 << 20  # Llama-3.1-8B in bf16 (docs/pd.md)


def test_a_load_without_a_rate_is_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "pd", "--prompt-rate", "0"])
    assert e.value.code == 2
    assert "prompt_rate=0.0, duration_s=120.0: both must be greater than 0" in capsys.readouterr().err
