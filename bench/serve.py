"""`raylm bench serve`: online serving over HTTP streaming, as `vllm bench serve` measures it.

Three ways to run it:
- against a running server (``--url``);
- ``--compare vllm [offline]``: it starts `raylm serve` (once per ``--raylm-variants``), then `vllm serve`, one
  at a time, drives each with the same client and requests, and prints the rows and their ratios; ``offline`` adds
  raylm's offline Ray engine on the same requests, and one prefill plus one decode step (TTFT's floor);
- ``--no-work-model``: the serving path's ceiling (serve_ceiling.py).

Either client drives the servers: ours (below), or ``--client vllm``, `vllm bench serve` itself (vllm_client.py).
For each server it starts, the row adds the CPU seconds its processes spent per 1,000 output tokens (cpu_meter.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu_meter import CpuMeter, cpu_report, print_cpu_report
from bench.servers import raylm_server, split_variant, vllm_server
from bench.throughput import offline_reference, throughput_workload
from bench.vllm_client import run_vllm_client
from engine.network import free_port


@dataclass(slots=True)
class Workload:
    """The requests of one run: (prompt token ids, output length) pairs, and how they arrive. With ``texts``, each
    prompt is sent as its text, whose tokens are those ids (what a client sends, and the replica tokenizes)."""

    requests: list[tuple[list[int], int]]
    request_rate: float
    description: str
    texts: list[str] | None = None

    def prompt(self, i: int) -> list[int] | str:
        return self.texts[i] if self.texts else self.requests[i][0]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p, _ in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.requests)


def make_workload(
    dataset: str,
    num_requests: int,
    vocab_size: int,
    *,
    input_len: int = 128,
    output_len: int = 128,
    min_len: int = 32,
    max_len: int = 256,
    request_rate: float = float("inf"),
    seed: int = 0,
    tokenizer: str | None = None,
) -> Workload:
    """``random``: fixed input and output lengths, random token ids (vllm bench serve's random dataset with a
    range ratio of 0); ``uniform``: both lengths uniform in [min_len, max_len] (the throughput benchmark's).
    With ``tokenizer`` (a directory), prompts are text: the random ids decoded, then encoded again (so a prompt's
    length may differ from the one asked by a token or two)."""
    if dataset == "random":
        rng = random.Random(seed)
        requests = [
            ([rng.randrange(100, vocab_size) for _ in range(input_len)], output_len) for _ in range(num_requests)
        ]
        shape = f"random {input_len} in / {output_len} out"
    elif dataset == "uniform":
        requests = throughput_workload(num_requests, min_len, max_len, vocab_size, seed)
        shape = f"lengths uniform in [{min_len}, {max_len}]"
    else:
        raise ValueError(f"dataset={dataset!r}: expected 'random' or 'uniform'")
    texts = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        texts = [tok.decode(p) for p, _ in requests]
        requests = [(tok.encode(t, add_special_tokens=False), n) for t, (_, n) in zip(texts, requests)]
    rate = "all at once" if request_rate == float("inf") else f"Poisson {request_rate:g} req/s"
    form = "text" if texts else "token-id"
    return Workload(
        requests,
        request_rate,
        f"{num_requests} requests, {shape} (seed {seed}, {form} prompts, ignore_eos), {rate}",
        texts,
    )


@dataclass(slots=True)
class StreamTimes:
    """One streamed request as the client saw it: when it was sent, when each chunk with text came, the
    tokens it reported (usage), and its error if it failed."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def completion_payload(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """The body `vllm bench serve` (openai-completions backend) sends, field for field."""
    return {
        "model": model,
        "prompt": prompt,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": max_tokens,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def stream_completion(session, url: str, payload: dict, headers: dict) -> StreamTimes:
    """POST one streamed completion; what the client saw of it (an error is recorded, never raised)."""
    t = StreamTimes(time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return t
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.error = chunk["error"]["message"]
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    t.chunks.append(time.perf_counter())
    except Exception as e:
        t.error = f"{type(e).__name__}: {e}"
    t.end = time.perf_counter()
    return t


async def _send_all(
    url: str, model: str, work: Workload, api_key: str | None, seed: int, meter: CpuMeter | None
) -> tuple[list[StreamTimes], float, dict[str, float]]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        warm = await stream_completion(session, url, completion_payload(model, work.prompt(0), 4), headers)
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        if meter:
            meter.start()
        t0 = time.perf_counter()
        tasks = []
        for i, (_, out_len) in enumerate(work.requests):
            tasks.append(
                asyncio.create_task(
                    stream_completion(session, url, completion_payload(model, work.prompt(i), out_len), headers)
                )
            )
            if work.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(work.request_rate))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t0
        return results, seconds, meter.stop() if meter else {}


def ms_stats(values: list[float]) -> dict:
    """Mean, median and p99 of seconds, in milliseconds (nan for none)."""
    import numpy as np

    v = np.asarray(values or [float("nan")]) * 1e3
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99))}


def served_model(url: str, api_key: str | None) -> str:
    request = urllib.request.Request(
        f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def engine_steps(url: str, api_key: str | None) -> float | None:
    """raylm's engine step counter from /metrics (None from a server without it, like vllm)."""
    request = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        m = re.search(r"^raylm:engine_steps_total\{[^}]*\} (\S+)$", r.read().decode(), re.MULTILINE)
    return float(m.group(1)) if m else None


def run_workload(
    name: str, url: str, work: Workload, api_key: str | None = None, seed: int = 0, meter: CpuMeter | None = None
) -> dict:
    """Drive ``work`` against the server at ``url``; print and return its row (with ``meter``, the CPU its
    processes spent per 1,000 output tokens)."""
    model = served_model(url, api_key)
    steps0 = engine_steps(url, api_key)
    results, seconds, cpu = asyncio.run(_send_all(url, model, work, api_key, seed, meter))
    steps1 = engine_steps(url, api_key)
    for r in results:
        if r.error is not None:
            print(f"  {name} failed: {r.error}")
    done = [(p, r) for (p, _), r in zip(work.requests, results) if r.error is None and r.chunks]
    ok = [r for _, r in done]
    output_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunks) for r in ok)
    row = {
        "name": name,
        "duration_s": seconds,
        "completed": len(ok),
        "num_requests": len(work.requests),
        "output_throughput": output_tokens / seconds,
        "total_throughput": (sum(len(p) for p, _ in done) + output_tokens) / seconds,
        "chunks_per_s": chunks / seconds,
        "tokens_per_chunk": output_tokens / max(chunks, 1),
        "steps_per_s": (steps1 - steps0) / seconds if steps0 is not None and steps1 is not None else None,
        "ttft": ms_stats([r.chunks[0] - r.sent for r in ok]),
        "tpot": ms_stats([(r.end - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl": ms_stats([b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]),
        "e2el": ms_stats([r.end - r.sent for r in ok]),
        "cpu": cpu_report(cpu, output_tokens) if meter else None,
    }
    print_row(row)
    return row


def print_row(row: dict) -> None:
    steps = f", {row['steps_per_s']:.1f} engine steps/s" if row["steps_per_s"] is not None else ""
    # vllm bench serve does not count SSE chunks
    chunks = (
        f", {row['chunks_per_s']:.0f} SSE chunks/s ({row['tokens_per_chunk']:.2f} tokens per chunk)"
        if row["chunks_per_s"] is not None
        else ""
    )
    print(
        f"  {row['name']}: {row['completed']}/{row['num_requests']} ok in {row['duration_s']:.1f} s, "
        f"{row['output_throughput']:.1f} output tok/s, {row['total_throughput']:.1f} total tok/s{chunks}{steps}; "
        f"load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    )
    for key in ("ttft", "tpot", "itl", "e2el"):
        s = row[key]
        print(f"    {key.upper():5s} ms   mean {s['mean']:9.1f}   median {s['median']:9.1f}   p99 {s['p99']:9.1f}")
    if row.get("cpu"):
        print_cpu_report(row["cpu"])


def _ratios(ours: dict, theirs: dict) -> None:
    cpu = ""
    if ours.get("cpu") and theirs.get("cpu"):
        outside = ours["cpu"]["outside_model"] / theirs["cpu"]["outside_model"]
        cpu = f", CPU s per 1k tokens outside the model {outside:.2f}x"
    print(
        f"  {ours['name']} / {theirs['name']}: output tok/s "
        f"{ours['output_throughput'] / theirs['output_throughput']:.2f}x, "
        + ", ".join(
            f"{k.upper()} {stat} {ours[k][stat] / theirs[k][stat]:.2f}x"
            for k in ("ttft", "tpot")
            for stat in ("mean", "median", "p99")
        )
        + cpu
    )


def bench_serve(
    url: str | None = None,
    model: str | None = None,
    work_args: dict | None = None,
    compare: list[str] = (),
    api_key: str | None = None,
    seed: int = 0,
    num_threads: int | None = None,
    client: str = "raylm",
    token_ids: bool = False,
    variants: list[str] = ("",),
) -> dict:
    """Against ``url``, or (with ``compare``) against servers it starts: raylm, then each peer. ``client``: ours
    (raylm) or `vllm bench serve` (vllm_client.py); ``token_ids``: our client sends token ids, not text;
    ``variants``: `raylm serve` is started once per variant (split_variant), one after the other."""
    model_path = model
    if model_path is None:
        from workers.default_model import default_model_path

        model_path = default_model_path()
    work_args = work_args or {}
    if client == "vllm" and work_args.get("dataset") != "random":
        raise ValueError(
            f"--client vllm runs vllm bench serve's random dataset: pass --dataset random "
            f"(not {work_args.get('dataset')!r})"
        )
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    work = make_workload(vocab_size=vocab_size, seed=seed, tokenizer=None if token_ids else model_path, **work_args)
    if client == "vllm":  # its own random dataset, of the same shape: the prompt lengths are its own
        print(f"raylm bench serve: vllm bench serve (unmodified), {work.description.split(' (seed')[0]}, text prompts")
    else:
        print(
            f"raylm bench serve: {work.description}, {work.prompt_tokens} prompt + {work.output_tokens} output tokens"
        )

    def drive(name: str, server_url: str, meter: CpuMeter | None = None) -> dict:
        if client == "vllm":
            model_name = served_model(server_url, api_key)
            row = run_vllm_client(name, server_url, model_name, model_path, work_args, seed, meter, api_key)
            print_row(row)
            return row
        return run_workload(name, server_url, work, api_key, seed, meter)

    if not compare:
        return {"raylm": drive(f"server at {url}", url)}
    rows: dict[str, dict] = {}
    threads = ["--num-threads", str(num_threads)] if num_threads else []
    model_args = ["--model", model] if model else []
    max_seqs = str(max(len(work.requests), 256))
    port = free_port()
    for i, variant in enumerate(variants):
        env, flags = split_variant(variant)
        with raylm_server(port, [*model_args, *threads, "--max-num-seqs", max_seqs, *flags], env) as server:
            rows["raylm" if i == 0 else f"raylm {variant}"] = drive(
                f"raylm serve {variant}".strip(), server.url, server.meter()
            )
            name = served_model(server.url, None)
    if "vllm" in compare:
        with vllm_server(port, model_path, name, int(max_seqs), num_threads) as server:
            rows["vllm"] = drive("vllm serve", server.url, server.meter())
        for key in [k for k in rows if k.startswith("raylm")]:
            _ratios(rows[key], rows["vllm"])
    if "offline" in compare:
        rows["offline"], rows["one_step_s"] = offline_reference(model, work.requests)
        print(
            f"  raylm serve / offline, output tok/s: "
            f"{rows['raylm']['output_throughput'] / rows['offline']['output_throughput']:.2f}x; "
            f"TTFT median / one prefill + decode step: "
            f"{rows['raylm']['ttft']['median'] / 1e3 / rows['one_step_s']:.2f}x"
        )
    return rows
