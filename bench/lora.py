"""`raylm bench lora`: output tok/s of one batch of requests mixing 1, 4, 16 LoRA adapters, against the same
requests on the base model alone (the batched LoRA op's cost) and against a per-adapter loop (each adapter's
requests as a batch of their own, one adapter after another: what serving without a batched op amounts to).

The adapters are random, in PEFT's format, of --rank on every q/k/v/o and gate/up/down module, written to a
temporary directory; one engine holds them all (max_loras = the largest mix) and runs every variant, base
requests included, so the variants differ only in the adapters their requests name, and with prefix caching off
(the variants repeat the same prompts). Greedy, ignore_eos: every request makes exactly --max-tokens tokens.

``--load-while-streaming N`` measures instead what loading an adapter at run time costs the streams running: N
streams on a Ray engine, one more adapter loaded (``add_lora``, as /v1/load_lora_adapter does) once the first
stream has a third of its tokens, then one request of it; it prints the longest gap between two chunks of a
stream across the load, across that request's first step (which copies the adapter into a slot) and overall,
against the median gap (a decode step: each stream gets a token a step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.cli_flags import add_engine_flags, engine_kwargs, llm_kwargs
from engine.config import EngineConfig
from engine.llm import LLM
from scheduler import EngineRequest, SamplingParams
from workers.lora import LORA_TARGETS, target_shapes
from workers.model_loader import read_model_spec
from workers.model_spec import ModelSpec


def write_adapter(root: Path, spec: ModelSpec, rank: int, seed: int) -> str:
    """A random PEFT adapter of `spec`'s model on every target module; B small enough to keep outputs sane."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (out, inp) in target_shapes(spec).items():
            prefix = f"base_model.model.model.layers.{layer}.{LORA_TARGETS[module][0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    root.mkdir(parents=True)
    save_file(tensors, root / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(LORA_TARGETS)}
    (root / "adapter_config.json").write_text(json.dumps(config))
    return str(root)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, names: list[str | None]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_lora(
    model: str | None,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    mixes: tuple[int, ...],
    rank: int,
    executor: str,
    address: str | None,
    **engine_kwargs,
) -> None:
    path = EngineConfig(model=model).resolved_model()
    spec = read_model_spec(path)
    num_adapters = max(mixes)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        modules = [f"a{i}={write_adapter(Path(tmp) / f'a{i}', spec, rank, i)}" for i in range(num_adapters)]
        # Prefix caching off: every variant runs the same prompts, and the looped one would reuse the KV the
        # batch computed for them under the same adapters.
        kwargs = dict(
            enable_lora=True,
            max_loras=num_adapters,
            max_lora_rank=rank,
            lora_modules=modules,
            enable_prefix_caching=False,
        )
        extra = {"address": address} if executor == "ray" else {}
        llm = LLM(model, executor=executor, **extra, **{**engine_kwargs, **kwargs})
        try:
            _run(llm, prompts[:2], params, ["a0", None])  # warm-up
            print(
                f"raylm bench lora: {spec.architecture}, {num_requests} requests of {prompt_len} prompt tokens and "
                f"{max_tokens} output tokens, rank-{rank} adapters on every q/k/v/o/gate/up/down, {executor} "
                f"executor, {torch.get_num_threads()} threads"
            )
            print(f"{'variant':<22} {'wall s':>8} {'out tok/s':>10} {'vs base':>8}")
            seconds, tokens = _run(llm, prompts, params, [None] * num_requests)
            base = tokens / seconds
            print(f"{'base model':<22} {seconds:>8.2f} {base:>10.1f} {1.0:>7.2f}x")
            for k in mixes:
                names = [f"a{i % k}" for i in range(num_requests)]
                seconds, tokens = _run(llm, prompts, params, names)
                print(
                    f"{f'{k} adapters, one batch':<22} {seconds:>8.2f} {tokens / seconds:>10.1f} "
                    f"{tokens / seconds / base:>7.2f}x"
                )
                seconds = tokens = 0
                for j in range(k):
                    mine = [p for i, p in enumerate(prompts) if i % k == j]
                    s, t = _run(llm, mine, params, [f"a{j}"] * len(mine))
                    seconds, tokens = seconds + s, tokens + t
                print(
                    f"{f'{k} adapters, looped':<22} {seconds:>8.2f} {tokens / seconds:>10.1f} "
                    f"{tokens / seconds / base:>7.2f}x"
                )
        finally:
            llm.shutdown()


async def _stream(
    engine, request_id: str, prompt: list[int], params: SamplingParams, times: list[float], lora: str | None = None
) -> None:
    async for _ in engine.generate(
        EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params, lora_name=lora)
    ):
        times.append(time.perf_counter())


async def _streams_while_loading(
    engine, prompts: list[list[int]], params: SamplingParams, path: str
) -> tuple[list[list[float]], tuple[float, float], tuple[float, float]]:
    """Each stream's chunk times; when the load started and ended; when the first request of the adapter loaded
    was sent and got its first token (its step copies the adapter into a slot)."""
    times: list[list[float]] = [[] for _ in prompts]
    tasks = [asyncio.create_task(_stream(engine, f"s{i}", p, params, times[i])) for i, p in enumerate(prompts)]
    while len(times[0]) < params.max_tokens // 3:
        await asyncio.sleep(0.001)
    start = time.perf_counter()
    await asyncio.to_thread(engine.add_lora, "loaded-late", path)
    end = time.perf_counter()
    mine: list[float] = []
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    await _stream(engine, "uses-it", prompts[0][:8], one_token, mine, "loaded-late")
    await asyncio.gather(*tasks)
    return times, (start, end), (end, mine[0])


def bench_lora_load(
    model: str | None,
    num_streams: int,
    prompt_len: int,
    max_tokens: int,
    rank: int,
    address: str | None,
    **engine_kwargs,
) -> None:
    from engine.ray_client import RayEngine  # Ray only where this benchmark runs

    config = EngineConfig(
        model=model, **{**engine_kwargs, "enable_lora": True, "max_lora_rank": rank, "enable_prefix_caching": False}
    )
    spec = read_model_spec(config.resolved_model())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_streams)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_adapter(Path(tmp) / "late", spec, rank, 0)
        size = (Path(path) / "adapter_model.safetensors").stat().st_size
        engine = RayEngine(config, address)
        try:
            asyncio.run(_streams_while_loading(engine, prompts[:2], SamplingParams(max_tokens=3), path))  # warm-up
            engine.remove_lora("loaded-late")
            times, (start, end), first_use = asyncio.run(_streams_while_loading(engine, prompts, params, path))
        finally:
            engine.shutdown()
    running = max(t[0] for t in times)  # every stream has its first token: the prompts are done
    gaps = [(b - a, a, b) for t in times for a, b in zip(t, t[1:]) if a >= running]
    step = statistics.median(g for g, _, _ in gaps)
    across = max((g for g, a, b in gaps if a < end and b > start), default=0.0)
    using = max((g for g, a, b in gaps if a < first_use[1] and b > first_use[0]), default=0.0)
    longest = max(g for g, _, _ in gaps)
    print(
        f"raylm bench lora --load-while-streaming: {spec.architecture}, {num_streams} streams of {prompt_len} prompt "
        f"and {max_tokens} output tokens; a rank-{rank} adapter on every q/k/v/o/gate/up/down ({size / 1e6:.1f} MB) "
        f"loaded mid-way in {(end - start) * 1e3:.0f} ms"
    )
    print(f"median gap between chunks (a step): {step * 1e3:.1f} ms")
    print(f"longest gap across the load:        {across * 1e3:.1f} ms ({across / step:.1f} steps)")
    print(f"longest gap as it is first used:    {using * 1e3:.1f} ms ({using / step:.1f} steps; its slot copy)")
    print(f"longest gap, all streams running:   {longest * 1e3:.1f} ms ({longest / step:.1f} steps)")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mixes", type=int, nargs="+", default=[1, 4, 16], help="adapters one batch mixes")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--load-while-streaming",
        type=int,
        default=0,
        metavar="N",
        help="instead: N streams (Ray executor) while an adapter loads mid-way; the longest gap between chunks",
    )
    add_engine_flags(p, exclude=("enable_lora", "max_loras", "max_lora_rank", "lora_modules"))


def main(args: argparse.Namespace) -> None:
    if args.load_while_streaming:
        bench_lora_load(
            num_streams=args.load_while_streaming,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            rank=args.rank,
            address=getattr(args, "address", None),
            **engine_kwargs(args),
        )
        return
    bench_lora(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        mixes=tuple(args.mixes),
        rank=args.rank,
        **llm_kwargs(args),
    )
