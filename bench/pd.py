"""`raylm bench pd`: prefill/decode disaggregation against the unified engine, with the same ranks, under the load
PD is for: long prompts arriving at a steady rate while short requests stream their decodes.

It starts `raylm serve` unified (data parallel: one replica per rank), then `raylm serve --pd` (prefill and decode
replicas, as many ranks in all), one at a time, drives each with the same mixed load (MixedLoad) and prints, per
server, ITL over every stream (the first gap of a PD stream holds the KV transfer), TTFT of each kind of request
and output tok/s, then PD's ratios to unified and the KV bytes each request moves under PD. `vllm bench serve`
draws one request shape at one rate per run, so it cannot express the two kinds at once; our client sends the
body it sends (serve.py completion_payload), prompts as token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from bench.serve import StreamTimes, completion_payload, ms_stats, served_model, stream_completion
from bench.servers import raylm_server
from bench.tenants import kv_bytes_per_token, wait_replicas
from engine.cli_flags import add_model_flag
from engine.config import EngineConfig
from engine.network import free_port


@dataclass(slots=True, frozen=True, kw_only=True)
class MixedLoad:
    """Long prompts of ``prompt_len`` random tokens, one every ``1 / prompt_rate`` s for ``duration_s``, each asking
    ``prompt_output_len`` tokens; beside them ``decodes`` streams, each sending a ``decode_prompt_len``-token prompt
    for ``decode_len`` tokens and, once it ends, the next, until ``duration_s`` has passed. Every prompt is its own
    random ids (no prefix-cache hit anywhere), drawn from ``seed``, so both servers get the same prompts."""

    prompt_len: int
    prompt_rate: float
    prompt_output_len: int
    decodes: int
    decode_prompt_len: int
    decode_len: int
    duration_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "prompt_output_len", "decodes", "decode_prompt_len", "decode_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.prompt_rate > 0 or not self.duration_s > 0:
            raise ValueError(
                f"prompt_rate={self.prompt_rate}, duration_s={self.duration_s}: both must be greater than 0"
            )

    @property
    def num_long_prompts(self) -> int:
        """Those sent at 0, 1 / rate, 2 / rate, ... before duration_s."""
        return -int(-self.duration_s * self.prompt_rate // 1)

    def describe(self) -> str:
        return (
            f"{self.num_long_prompts} prompts of {self.prompt_len} tokens ({self.prompt_output_len} out) at "
            f"{self.prompt_rate:g}/s beside {self.decodes} streams of {self.decode_prompt_len}-token prompts "
            f"decoding {self.decode_len} tokens each, back to back, for {self.duration_s:g} s (seed {self.seed}, "
            f"token-id prompts, ignore_eos)"
        )


@dataclass(slots=True)
class MixedTimes:
    """What the client saw of one run: each long prompt's stream, each decode stream's, and the seconds from the
    first request sent to the last stream's end."""

    long: list[StreamTimes]
    decode: list[StreamTimes]
    seconds: float


async def drive(url: str, model: str, load: MixedLoad, vocab_size: int, api_key: str | None = None) -> MixedTimes:
    """Run ``load`` against the server at ``url`` after one warm-up request."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def prompt(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def send(p: list[int], max_tokens: int) -> StreamTimes:
            return await stream_completion(session, url, completion_payload(model, p, max_tokens), headers)

        warm = await send(prompt(random.Random(-1), load.decode_prompt_len), 4)
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        t0 = time.perf_counter()
        end = t0 + load.duration_s

        async def decode_stream(i: int) -> list[StreamTimes]:
            rng, done = random.Random(f"{load.seed}-decode-{i}"), []
            while time.perf_counter() < end:
                done.append(await send(prompt(rng, load.decode_prompt_len), load.decode_len))
            return done

        async def long_prompts() -> list[StreamTimes]:
            rng, sent = random.Random(f"{load.seed}-long"), []
            for k in range(load.num_long_prompts):
                await asyncio.sleep(max(0.0, t0 + k / load.prompt_rate - time.perf_counter()))
                sent.append(asyncio.create_task(send(prompt(rng, load.prompt_len), load.prompt_output_len)))
            return list(await asyncio.gather(*sent))

        *decodes, long = await asyncio.gather(*(decode_stream(i) for i in range(load.decodes)), long_prompts())
        return MixedTimes(long, [s for d in decodes for s in d], time.perf_counter() - t0)


def stats(seconds: list[float]) -> dict:
    """ms_stats and the largest: a prefill that stalls a step shows in the few worst gaps, which p99 may not reach."""
    return ms_stats(seconds) | {"max": max(seconds, default=float("nan")) * 1e3}


def mixed_row(name: str, times: MixedTimes) -> dict:
    """The run's figures: failures, output tok/s, ITL over every stream and its first gap alone (under PD the
    handoff to the decode engine: the KV transfer, admission, one decode step), TTFT of each kind (milliseconds)."""
    ok = {kind: [s for s in getattr(times, kind) if s.error is None and s.chunks] for kind in ("long", "decode")}
    every = ok["long"] + ok["decode"]
    return {
        "name": name,
        "duration_s": times.seconds,
        "completed": len(every),
        "num_requests": len(times.long) + len(times.decode),
        "errors": [s.error for s in times.long + times.decode if s.error is not None],
        "output_throughput": sum(s.output_tokens for s in every) / times.seconds,
        "itl": stats([b - a for s in every for a, b in zip(s.chunks, s.chunks[1:])]),
        "first_gap": stats([s.chunks[1] - s.chunks[0] for s in every if len(s.chunks) > 1]),
        "ttft_long": stats([s.chunks[0] - s.sent for s in ok["long"]]),
        "ttft_decode": stats([s.chunks[0] - s.sent for s in ok["decode"]]),
    }


ROW_STATS = {
    "itl": "ITL, every stream",
    "first_gap": "ITL, first gap",
    "ttft_long": "TTFT, long prompts",
    "ttft_decode": "TTFT, decode streams",
}


def print_mixed_row(row: dict) -> None:
    print(
        f"  {row['name']}: {row['completed']}/{row['num_requests']} ok in {row['duration_s']:.1f} s, "
        f"{row['output_throughput']:.1f} output tok/s; load average "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    )
    for error in sorted(set(row["errors"])):
        print(f"    failed: {error}")
    for key, label in ROW_STATS.items():
        s = row[key]
        print(f"    {label + ' ms':24s} median {s['median']:8.1f}   p99 {s['p99']:8.1f}   max {s['max']:8.1f}")


def print_ratios(pd: dict, unified: dict) -> None:
    ratios = [f"output tok/s {pd['output_throughput'] / unified['output_throughput']:.2f}x"] + [
        f"{label} {stat} {pd[key][stat] / unified[key][stat]:.2f}x"
        for key, label in ROW_STATS.items()
        for stat in ("median", "p99")
    ]
    print(f"  {pd['name']} / {unified['name']}: " + "; ".join(ratios))


def kv_transfer_bytes(prompt_len: int, block_size: int, bytes_per_token: int) -> int:
    """What one prompt's KV weighs in transit from prefill to decode ranks with no prefix hit: every block the
    prompt fills, the last one whole though partly filled (the ranks send blocks)."""
    return -(-prompt_len // block_size) * block_size * bytes_per_token


def print_kv_bytes(load: MixedLoad, times: MixedTimes, block_size: int, bytes_per_token: int) -> None:
    """The KV the PD run moved, from the model's shape and the prompts it served (raylm exports no counter)."""
    long = kv_transfer_bytes(load.prompt_len, block_size, bytes_per_token)
    short = kv_transfer_bytes(load.decode_prompt_len, block_size, bytes_per_token)
    moved = long * len(times.long) + short * len(times.decode)
    print(
        f"  KV moved per request under PD ({bytes_per_token:,} B/token, blocks of {block_size}): "
        f"{long / 2**20:.1f} MiB per {load.prompt_len}-token prompt, {short / 2**20:.2f} MiB per "
        f"{load.decode_prompt_len}-token one; {moved / times.seconds / 2**20:.1f} MiB/s over the run"
    )


def run_server(name: str, flags: list[str], replicas: int, load: MixedLoad, vocab_size: int) -> tuple[dict, MixedTimes]:
    """Start `raylm serve` with ``flags``, wait until ``replicas`` replicas show in /metrics, drive ``load``; its
    row and times."""
    with raylm_server(free_port(), flags, env={"RAY_metrics_report_interval_ms": "1000"}) as server:
        wait_replicas(server.url, replicas)
        times = asyncio.run(drive(server.url, served_model(server.url, None), load, vocab_size))
    row = mixed_row(name, times)
    print_mixed_row(row)
    return row, times


def bench_pd(
    model: str | None,
    load: MixedLoad,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    num_threads: int = 1,
    serve_flags: str = "",
) -> dict[str, dict]:
    """Unified with ``prefill_replicas + decode_replicas`` replicas, then PD with those, every engine of one rank
    with ``num_threads`` torch threads and ``serve_flags`` (more `raylm serve` flags, as a shell would split them;
    PD's prefill side takes them too); prints both rows, PD's ratios and the KV it moved."""
    from workers.default_model import default_model_path

    model_path = model or default_model_path()
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    block_size = EngineConfig(model=model_path, device="cpu").block_size
    print(f"raylm bench pd: {load.describe()}" + (f"; both servers with {serve_flags}" if serve_flags else ""))
    common = [*(["--model", model] if model else []), "--num-threads", str(num_threads), *shlex.split(serve_flags)]
    replicas = prefill_replicas + decode_replicas
    unified, _ = run_server(
        f"unified ({replicas} replicas)",
        [*common, "--min-replicas", str(replicas), "--max-replicas", str(replicas)],
        replicas,
        load,
        vocab_size,
    )
    prefill = json.dumps({"min_replicas": prefill_replicas, "max_replicas": prefill_replicas})
    # /metrics counts the decode replicas; /health answers only once a prefill replica serves too
    pd, pd_times = run_server(
        f"pd ({prefill_replicas} prefill + {decode_replicas} decode)",
        [*common, "--pd", "--prefill-config", prefill, "--min-replicas", str(decode_replicas)]
        + ["--max-replicas", str(decode_replicas)],
        decode_replicas,
        load,
        vocab_size,
    )
    print_ratios(pd, unified)
    print_kv_bytes(load, pd_times, block_size, kv_bytes_per_token(model_path))
    return {"unified": unified, "pd": pd}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "SmolLM2")
    p.add_argument("--prompt-len", type=int, default=1024, help="the long prompts' tokens")
    p.add_argument("--prompt-rate", type=float, default=0.1, help="long prompts per second, evenly spaced")
    p.add_argument("--prompt-output-len", type=int, default=16, help="tokens each long prompt asks")
    p.add_argument("--decodes", type=int, default=12, help="decode streams, each sending its next request at once")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=96, help="tokens each decode request asks")
    p.add_argument("--duration-s", type=float, default=120.0, help="how long requests are sent, per server")
    p.add_argument("--prefill-replicas", type=int, default=1, help="PD's prefill replicas (unified: their sum)")
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of every engine's rank")
    p.add_argument(
        "--serve-flags",
        default="",
        help="more raylm serve flags for both servers, quoted (PD's prefill side takes them too), "
        "e.g. '--max-num-batched-tokens 256'",
    )
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    load = MixedLoad(
        prompt_len=args.prompt_len,
        prompt_rate=args.prompt_rate,
        prompt_output_len=args.prompt_output_len,
        decodes=args.decodes,
        decode_prompt_len=args.decode_prompt_len,
        decode_len=args.decode_len,
        duration_s=args.duration_s,
        seed=args.seed,
    )
    bench_pd(args.model, load, args.prefill_replicas, args.decode_replicas, args.num_threads, args.serve_flags)
