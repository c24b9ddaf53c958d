"""raylm bench soak: a fixed-rate mix of requests for a set time against one server, then what it left behind.

The mix is what a careless crowd sends: streaming and not, n > 1, stop strings, logprobs, chat, requests the
server must refuse, and streams whose clients go away at random; against a server that schedules by
priority, every request carries a random one (under fcfs a non-zero priority is one of the refused
requests). It reports requests by outcome, the 5xx count, p99 latency per window of the run, each server
process's resident memory at the start and the end, and the engine's requests and KV usage once the run has
drained. ``check`` turns that into failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.cli_flags import add_model_flag
from engine.config import SCHEDULING_POLICIES

# Ray names each process after its actor class: the replica, the scheduler and the ranks.
PROCESSES = {"replica": "ray::ServeReplica:", "scheduler": "ray::SchedulerActor", "rank": "ray::WorkerActor"}
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
KINDS = ("complete", "stream", "n2", "stop", "logprobs", "chat", "bad", "disconnect")
DRAIN_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Outcome:
    """One request: its kind, how it ended ("ok", "refused" for an expected 4xx, "disconnected", "429",
    "5xx", "stream-error", "transport"), when it was sent (seconds into the run) and its latency."""

    kind: str
    result: str
    sent: float
    latency: float


@dataclass(slots=True)
class SoakReport:
    outcomes: list[Outcome]
    rss_start: dict[str, int]
    rss_end: dict[str, int]
    drained: tuple[float, ...] | str  # ENGINE_GAUGES after the run, or why they could not be read
    window_s: float
    rss_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (seconds into the run, rss)
    by_result: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.by_result = Counter((o.kind, o.result) for o in self.outcomes)

    @property
    def num_5xx(self) -> int:
        return sum(1 for o in self.outcomes if o.result == "5xx")

    def p99_by_window(self) -> list[tuple[float, float, int]]:
        """(window start, p99 latency of the requests sent in it, their count), for requests that completed."""
        windows: dict[int, list[float]] = {}
        for o in self.outcomes:
            if o.result == "ok":
                windows.setdefault(int(o.sent // self.window_s), []).append(o.latency)
        return [(w * self.window_s, percentile(lat, 0.99), len(lat)) for w, lat in sorted(windows.items())]

    def growth(self, name: str) -> float:
        """Resident memory growth of a process kind, end over start, minus 1."""
        return self.rss_end[name] / self.rss_start[name] - 1

    def print(self) -> None:
        print(f"requests: {len(self.outcomes)}; 5xx: {self.num_5xx}")
        for (kind, result), n in sorted(self.by_result.items()):
            print(f"  {kind:10s} {result:13s} {n}")
        print("p99 latency of completed requests, by window sent:")
        for start, p99, n in self.p99_by_window():
            print(f"  {start:6.0f} s  p99 {p99:6.2f} s  ({n} requests)")
        print(
            "resident memory (MiB), start -> end, and every window between (a leak climbs; a high-water mark "
            "of a backlog steps up once):"
        )
        for name in self.rss_start:
            series = " ".join(f"{sample[name] / 2**20:.0f}" for _, sample in self.rss_samples)
            print(
                f"  {name:10s} {self.rss_start[name] / 2**20:8.1f} -> {self.rss_end.get(name, 0) / 2**20:8.1f}"
                f"  ({self.growth(name):+.1%})  [{series}]"
            )
        print(f"after draining: running, waiting, KV usage = {self.drained}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def check(report: SoakReport, max_growth: float) -> list[str]:
    """What the run got wrong: any 5xx or stream error, a valid request refused (a 4xx other than 429's
    back-pressure), anything left in the engine, memory growth of the replica or the scheduler beyond
    ``max_growth``, or a kind that never completed."""
    problems = [f"{report.num_5xx} responses were 5xx"] if report.num_5xx else []
    refused = Counter(o.kind for o in report.outcomes if o.kind != "bad" and o.result[0] == "4" and o.result != "429")
    if refused:
        problems.append(f"valid requests refused with a 4xx, by kind: {dict(refused)}")
    if errors := sum(1 for o in report.outcomes if o.result in ("stream-error", "transport")):
        problems.append(f"{errors} requests ended with an error event or a broken connection")
    if report.drained != (0, 0, 0):
        problems.append(f"after draining the engine still holds (running, waiting, KV usage) {report.drained}")
    for name in ("replica", "scheduler"):
        if report.growth(name) > max_growth:
            problems.append(f"the {name}'s resident memory grew {report.growth(name):.1%} (bound {max_growth:.0%})")
    for kind in KINDS:
        want = {"bad": "refused", "disconnect": "disconnected"}.get(kind, "ok")
        if not report.by_result[(kind, want)]:
            problems.append(f"no {kind} request ended {want}")
    return problems


# ---- the load ------------------------------------------------------------------------------------------


def request_body(kind: str, model: str, rng: random.Random, max_tokens: int, priorities: bool) -> tuple[str, dict]:
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran"]) for _ in range(20))
    body = {
        "model": model,
        "prompt": words,
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": 0.8,
        "seed": rng.randrange(1 << 30),
    }
    priority = {"priority": rng.randint(-5, 5)} if priorities else {}
    body |= priority
    match kind:
        case "stream" | "disconnect":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        case "n2":
            body |= {"n": 2}
        case "stop":
            body |= {"stop": ["the", "\n"]}
        case "logprobs":
            body |= {"logprobs": 2}
        case "chat":
            return "/v1/chat/completions", {
                "model": model,
                "messages": [{"role": "user", "content": words}],
                "max_completion_tokens": body["max_tokens"],
                "stream": rng.random() < 0.5,
                **priority,
            }
        case "bad":
            body |= rng.choice(
                [
                    {"temperature": -1},
                    {"max_tokens": 0},
                    {"prompt": "\udcff"},
                    {"n": 0},
                    {"unknown_field": 1},
                    {"logprobs": 99},
                    {"priority": "high" if priorities else 1},
                ]
            )
    return "/v1/completions", body


async def one(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    model: str,
    rng: random.Random,
    max_tokens: int,
    priorities: bool,
    t0: float,
) -> Outcome:
    path, body = request_body(kind, model, rng, max_tokens, priorities)
    sent = time.monotonic()
    leave_after = rng.randint(1, 4)  # chunks a disconnecting client reads
    try:
        # json.dumps escapes a lone surrogate (a "bad" prompt) where httpx's own encoder would raise on it.
        async with client.stream(
            "POST", f"{url}{path}", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        ) as r:
            if r.status_code != 200:
                await r.aread()
                result = (
                    "5xx"
                    if r.status_code >= 500
                    else "429"
                    if r.status_code == 429
                    else "refused"
                    if kind == "bad"
                    else f"{r.status_code}"
                )
            elif not body.get("stream"):
                await r.aread()
                result = "ok" if "error" not in r.json() else "stream-error"
            else:
                result = "ok"
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):
                        result = "stream-error"
                    chunks += line.startswith("data: ")
                    if kind == "disconnect" and chunks >= leave_after:
                        result = "disconnected"
                        break
    except httpx.TransportError:
        result = "transport"
    return Outcome(kind, result, sent - t0, time.monotonic() - sent)


async def run_load(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    max_tokens: int,
    seed: int,
    headers: dict[str, str],
    priorities: bool,
) -> list[Outcome]:
    """Send ``rate`` requests per second (a fixed schedule, whatever the server's pace) for ``duration_s``;
    return each one's outcome once all have ended."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.monotonic()
        tasks = []
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(
                asyncio.create_task(
                    one(client, url, rng.choice(KINDS), model, random.Random(rng.random()), max_tokens, priorities, t0)
                )
            )
        return list(await asyncio.gather(*tasks))


# ---- the server's processes and engine -------------------------------------------------------------------


def descendant_pids(title: str) -> list[int]:
    """Pids of processes started (at any depth) by this one whose title starts with ``title``: the Ray this
    process or a server it started runs, and not other Ray sessions on the machine."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process has gone
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                found.append(pid)
        except OSError:
            pass
    return found


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def resident_memory() -> dict[str, int]:
    """Each kind of server process's resident bytes (summed over the ranks)."""
    return {name: sum(rss(pid) for pid in descendant_pids(title)) for name, title in PROCESSES.items()}


def engine_gauges(url: str, headers: dict[str, str]) -> tuple[float, ...] | str:
    """The engine's requests running and waiting and its KV usage, from /metrics, or what answered instead."""
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    samples = (
        {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples}
        if r.status_code == 200
        else {}
    )
    if not all(g in samples for g in ENGINE_GAUGES):
        return f"{r.status_code} {r.text[:300]}"
    return tuple(samples[g] for g in ENGINE_GAUGES)


def drained(url: str, headers: dict[str, str]) -> tuple[float, ...] | str:
    """The engine gauges once they read (0, 0, 0), or their last reading after DRAIN_TIMEOUT_S."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while (gauges := engine_gauges(url, headers)) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    return gauges


def soak(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    max_tokens: int = 32,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    warmup_s: float = 10.0,
    window_s: float = 30.0,
    priorities: bool = False,
) -> SoakReport:
    """A warm-up at the same rate (so that start-up allocations are not counted as growth), then the run, its
    processes' resident memory sampled every window. ``priorities``: the server schedules by priority."""
    headers = headers or {}
    asyncio.run(run_load(url, model, rate, warmup_s, max_tokens, seed + 1, headers, priorities))
    drained(url, headers)
    start = resident_memory()
    samples: list[tuple[float, dict[str, int]]] = []
    done = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not done.wait(window_s):
            samples.append((time.monotonic() - t0, resident_memory()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        outcomes = asyncio.run(run_load(url, model, rate, duration_s, max_tokens, seed, headers, priorities))
    finally:
        done.set()
        sampler.join()
    after = drained(url, headers)
    return SoakReport(outcomes, start, resident_memory(), after, window_s, samples)


def bench_soak(
    model: str | None,
    rate: float,
    duration_s: float,
    max_tokens: int,
    max_growth: float,
    seed: int,
    scheduling_policy: str,
) -> None:
    """`raylm bench soak`: start `raylm serve` (the default model unless --model) with this scheduling policy,
    run the mix, print the report, and exit non-zero on any problem ``check`` finds."""
    from bench.servers import raylm_server
    from engine.config import DEFAULT_MODEL_NAME
    from engine.network import free_port

    args = [*(["--model", model] if model else []), "--scheduling-policy", scheduling_policy]
    with raylm_server(free_port(), args) as server:
        # The warm-up is a tenth of the run (at least 10 s): long enough for the allocator to reach the
        # high-water mark of the run's usual backlog, so that what grows after it is growth.
        report = soak(
            server.url,
            model or DEFAULT_MODEL_NAME,
            rate,
            duration_s,
            max_tokens,
            seed,
            warmup_s=max(10.0, duration_s / 10),
            window_s=max(10.0, duration_s / 10),
            priorities=scheduling_policy == "priority",
        )
    report.print()
    if problems := check(report, max_growth):
        raise SystemExit("soak failed:\n  " + "\n  ".join(problems))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "SmolLM2")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1 to this many tokens")
    p.add_argument(
        "--max-growth",
        type=float,
        default=0.05,
        help="resident memory growth of the replica and the scheduler that fails the run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the server's; with priority every request carries a random one",
    )


def main(args: argparse.Namespace) -> None:
    bench_soak(
        args.model, args.rate, args.duration_s, args.max_tokens, args.max_growth, args.seed, args.scheduling_policy
    )
