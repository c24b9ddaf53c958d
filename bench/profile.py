"""`raylm bench profile`: where a decode step's time goes, from torch.profiler.

An in-process engine decodes a batch of requests of about `context` tokens; after as many unprofiled steps (the
host's wall time per step, and a warm-up), the profiler records one more step it discards (its own start-up)
and then `steps` steps, each inside `record_function("raylm.step")`. On CUDA the work is the GPU's kernels
(copies and memsets included: they hold the GPU too); on CPU it is the top-level ops, those no other op
called (what the model code calls). Per batch size it prints: work items per step, busy time per step (the
union of their intervals, so overlapping streams count once), idle time per step (the profiled step's host span
minus busy), split into the gaps between items within a step and the gap between one step's last item and the
next step's first (the idle between steps, as a share of the step), the top items by total time, and the items
of one decoder layer in order (`layer_slice`). The profiler's own overhead slows the host, so the profiled
step is longer than the unprofiled one and its idle time an upper bound.

The analysis takes plain (name, start µs, duration µs) events, so it runs without a profiler.
"""

from __future__ import annotations

import argparse
import bisect
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.throughput import start_decoding
from engine.cli_flags import add_engine_flags, engine_kwargs

STEP = "raylm.step"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of what occupies the GPU
TOP = 15

Event = tuple[str, float, float]  # name, start µs, duration µs


def merge(intervals) -> list[tuple[float, float]]:
    """The union of (start, duration) intervals, as disjoint (start, end) spans in order."""
    spans: list[tuple[float, float]] = []
    for start, duration in sorted(intervals):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], start + duration))
        else:
            spans.append((start, start + duration))
    return spans


def busy_and_idle(intervals) -> tuple[float, float]:
    """(busy, idle) of (start, duration) intervals: busy the length of their union, idle the gaps inside their span."""
    spans = merge(intervals)
    if not spans:
        return 0.0, 0.0
    busy = sum(end - start for start, end in spans)
    return busy, spans[-1][1] - spans[0][0] - busy


def split_steps(events: list[Event], step_starts: list[float]) -> list[list[Event]]:
    """`events` by step (`step_starts` ascending): each in the last step that began at or before it, since a
    kernel may still run after its step's host code returned; events before the first step are left out."""
    steps: list[list[Event]] = [[] for _ in step_starts]
    for event in events:
        i = bisect.bisect_right(step_starts, event[1]) - 1
        if i >= 0:
            steps[i].append(event)
    return steps


def between_steps(steps: list[list[Event]]) -> list[float]:
    """The idle between consecutive steps: the next step's first start minus this step's last end (0 where
    they overlap); steps with no events are skipped."""
    spans = [(min(s for _, s, _ in step), max(s + d for _, s, d in step)) for step in steps if step]
    return [max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(spans, spans[1:])]


def top_kernels(events: list[Event], steps: int, n: int = TOP) -> list[tuple[str, float, float, float]]:
    """The `n` names of most total time: (name, count per step, mean duration, share of all events' summed time,
    which is the busy time where they never overlap: one stream, or one thread's top-level ops)."""
    totals: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for name, _, duration in events:
        totals[name] += duration
        counts[name] += 1
    summed = sum(totals.values()) or 1.0
    ranked = sorted(totals, key=lambda name: -totals[name])[:n]
    return [(name, counts[name] / steps, totals[name] / counts[name], totals[name] / summed) for name in ranked]


def layer_slice(names: list[str], num_layers: int, layer: int) -> tuple[int, list[str]] | None:
    """Layer `layer`'s run of one step's names in order, and its index in the step; None when `num_layers` < 2 or
    no layer repeats.

    A candidate layer length is the spacing of a name that occurs exactly `num_layers` times, evenly spaced (the
    attention kernel, rotary, ...). Kept is the candidate that repeats over the most names: from its first
    occurrence on, over `num_layers` - 1 layers, the names equal to the name one layer later; at least half must
    be (a spurious candidate, such as a name the prologue holds twice side by side, repeats over a few names
    only). The run starts at that first occurrence, moved back while the name before it equals the one a layer
    later, so that it starts where the repeat starts. Layer 0's plain input norm differs from the other layers'
    fused residual add and norm: that fused norm then ends each run instead of starting it."""
    if num_layers < 2:
        return None
    at: dict[str, list[int]] = defaultdict(list)
    for i, name in enumerate(names):
        at[name].append(i)
    candidates = [(w[0], w[1] - w[0]) for w in at.values() if len(w) == num_layers and len(set(_spacings(w))) == 1]
    if not candidates:
        return None
    start, length = max(candidates, key=lambda c: (_repeats(names, *c, num_layers), -c[0]))
    if 2 * _repeats(names, start, length, num_layers) < (num_layers - 1) * length:
        return None
    while start > 0 and names[start - 1] == names[start - 1 + length]:
        start -= 1
    start += layer * length
    return start, names[start : start + length]


def _spacings(positions: list[int]) -> list[int]:
    return [b - a for a, b in zip(positions, positions[1:])]


def _repeats(names: list[str], first: int, length: int, num_layers: int) -> int:
    """How many of the names of `num_layers` - 1 layers from `first` on equal the name a layer later."""
    end = min(first + (num_layers - 1) * length, len(names) - length)
    return sum(names[i] == names[i + length] for i in range(first, end))


@dataclass
class StepProfile:
    """What the profiled steps of one batch show; times in µs, per step (means over the steps)."""

    step_us: float  # the host's span of a profiled step
    counts: list[int]  # work items of each step
    busy_us: float
    gaps_us: float  # idle between the items within a step
    between_us: float  # idle between one step's last item and the next step's first
    top: list[tuple[str, float, float, float]]  # top_kernels
    layer_index: int  # the middle layer: the first and last may differ from the rest
    layer: tuple[int, list[str]] | None  # its layer_slice in the last step

    @property
    def idle_us(self) -> float:
        return self.step_us - self.busy_us


def step_profile(marks: list[tuple[float, float]], events: list[Event], num_layers: int) -> StepProfile:
    """The figures of steps whose host spans are `marks` ((start, end) µs, ascending) and work is `events`."""
    steps = split_steps(sorted(events, key=lambda e: e[1]), [start for start, _ in marks])
    busy_idle = [busy_and_idle((s, d) for _, s, d in step) for step in steps]
    between = between_steps(steps)
    return StepProfile(
        step_us=_mean([end - start for start, end in marks]),
        counts=[len(step) for step in steps],
        busy_us=_mean([busy for busy, _ in busy_idle]),
        gaps_us=_mean([idle for _, idle in busy_idle]),
        between_us=_mean(between),
        top=top_kernels([e for step in steps for e in step], len(steps)),
        layer_index=num_layers // 2,
        layer=layer_slice([name for name, _, _ in steps[-1]], num_layers, num_layers // 2),
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def profiled_steps(engine, steps: int, cuda: bool, trace: str | None) -> tuple[list[tuple[float, float]], list[Event]]:
    """Run `steps` engine steps under torch.profiler (after one it discards: the profiler's start-up slows it):
    each step's host (start, end) µs, and the work events: GPU kernels on CUDA, top-level CPU ops otherwise."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        for _ in range(steps + 1):
            with record_function(STEP):
                engine.step()
            prof.step()
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.events()
    # The host's marks, not their copies on the GPU's timeline (gpu_user_annotation).
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP and _annotation(e))
    work = _on_gpu if cuda else _top_level_op
    return marks, [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events if work(e)]


def _on_gpu(event) -> bool:
    return event.activity_type in GPU_WORK


def _annotation(event) -> bool:
    return event.activity_type == "user_annotation"


def _top_level_op(event) -> bool:
    """An op no other op called: only annotations (record_function's, the profiler's steps) above it."""
    if event.activity_type != "cpu_op":
        return False
    parent = event.cpu_parent
    while parent is not None and _annotation(parent):
        parent = parent.cpu_parent
    return parent is None


def profile_batch(engine, batch: int, context: int, steps: int, trace: str | None, rng: random.Random) -> None:
    """Decode `batch` requests: `steps` steps timed, then profiled; print the figures."""
    cuda = str(engine.device).startswith("cuda")
    start_decoding(engine, batch, context, 2 * steps + 1, rng)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    found = step_profile(*profiled_steps(engine, steps, cuda, trace), engine.spec.num_layers)
    while engine.has_unfinished_requests():
        engine.step()
    _print_batch(found, batch, context + steps + steps // 2, wall, "kernels" if cuda else "ops")


def _print_batch(found: StepProfile, batch: int, tokens: int, wall_s: float, what: str) -> None:
    ms = 1e-3
    step, counts = found.step_us, found.counts
    per_step = f"{counts[0]}" if len(set(counts)) == 1 else f"{_mean(counts):.1f} (from {min(counts)} to {max(counts)})"
    print(
        f"  batch {batch} at ~{tokens} tokens: {wall_s * 1e3:.2f} ms per step, {step * ms:.2f} ms profiled; "
        f"{per_step} {what} per step"
    )
    print(
        f"    busy {found.busy_us * ms:.2f} ms per step ({found.busy_us / step:.0%} of the profiled step), idle "
        f"{found.idle_us * ms:.2f} ms: {found.gaps_us * ms:.2f} ms between {what} in the step, "
        f"{found.between_us * ms:.2f} ms between steps ({found.between_us / step:.0%} of the step)"
    )
    print(f"    {'top ' + what:60s} {'per step':>8s} {'mean µs':>9s} {'share':>6s}")
    for name, count, mean_us, share in found.top:
        print(f"      {_short(name, 58):58s} {count:8.1f} {mean_us:9.1f} {share:6.1%}")
    if found.layer is None:
        print(f"    no {what[:-1]} runs once per layer at a fixed spacing: no layer's {what} to show")
        return
    start, names = found.layer
    print(
        f"    layer {found.layer_index}'s {len(names)} {what}, in order ({start} to {start + len(names) - 1} of the "
        f"last step's):"
    )
    for name in names:
        print(f"      {_short(name, 110)}")


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _trace_path(trace: str | None, batch: int) -> str | None:
    if trace is None:
        return None
    path = Path(trace)
    return str(path.with_name(f"{path.stem}-batch{batch}{path.suffix}"))


def bench_profile(
    batches: tuple[int, ...] = (1, 32, 256),
    context: int = 512,
    steps: int = 20,
    trace: str | None = None,
    **engine_kwargs,
) -> None:
    """Profile the decode steps of an in-process engine at each batch size in `batches` (those it cannot run
    whole: skipped, saying why); `trace`: a Chrome trace per batch, named FILE-batchB.json."""
    from engine.config import EngineConfig
    from engine.inprocess import InProcessEngine

    engine_kwargs.setdefault("max_num_seqs", max(batches))
    engine = InProcessEngine(EngineConfig(**engine_kwargs))
    runner = engine.worker.runner
    print(
        f"raylm bench profile: {steps} decode steps timed, then {steps} profiled, per batch of random prompts of "
        f"{context} tokens; model {engine.model_path}, {engine.worker.dtype}, device {engine.device}, "
        f"{engine.spec.num_layers} layers, backend {runner.attn_backend.name}, "
        f"{'CUDA graphs' if runner.decode_graphs.graphs else 'eager'}"
    )
    rng = random.Random(0)
    try:
        for batch in batches:
            if batch > engine.config.max_num_seqs or batch >= engine.config.max_num_batched_tokens:
                print(f"  batch {batch}: skipped, over max_num_seqs or max_num_batched_tokens")
                continue
            try:
                profile_batch(engine, batch, context, steps, _trace_path(trace, batch), rng)
            except ValueError as e:  # the KV cache cannot hold the batch
                print(f"  batch {batch}: skipped, {e}")
    finally:
        engine.shutdown()


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="requests decoding at once, one run each")
    p.add_argument("--context", type=int, default=512, help="each request's prompt tokens")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    p.add_argument("--trace", default=None, metavar="FILE", help="a Chrome trace per batch: FILE-batchB.json")
    add_engine_flags(p)


def main(args: argparse.Namespace) -> None:
    bench_profile(tuple(args.batch), args.context, args.steps, args.trace, **engine_kwargs(args))
