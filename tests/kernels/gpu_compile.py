"""Every Triton kernel of kernels/ compiled by Triton's real compiler for GPU targets, on a machine with no GPU.

    python -m tests.kernels.gpu_compile [--arch 90 --arch 89 ...]

The CPU suite runs the kernels under TRITON_INTERPRET=1, which never runs the compiler: a kernel can pass there and
fail to compile for a GPU (a bf16 tl.dot, which the interpreter cannot even run, a float8 dot's layout, a misused
constexpr, a type error in a branch the interpreter never took). Here the project's wrappers run on CPU tensors, in
the dtypes and model shapes of the GPU path, with each launch recorded instead of run (the outputs are garbage, and
no wrapper reads one back); each launch is then specialised as Triton's launcher would specialise it on a GPU (its
signature, constexprs, the alignment attributes of its pointers and ints, its options) and compiled down to a
cubin by the ptxas Triton ships. A variant whose shared memory exceeds what the arch lets one program take fails
too: it would compile, then fail at launch.

Float8 (a float8 tensor among the launch's arguments) needs compute capability 8.9: those launches compile for
archs 89 and up only. Run without TRITON_INTERPRET (tests/kernels/test_gpu_compile.py runs it in a subprocess).
One line per compiled variant, a summary, and exit status 1 listing every failure with its error.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

DEFAULT_ARCHS = (90, 89, 80)  # Hopper (H100, H200), Ada (L4, L40S), Ampere (A100): no float8 there
FP8_MIN_ARCH = 89
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# CUDA's opt-in limit of shared memory per block (Triton's launcher refuses a kernel that needs more).
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

# Llama-3-8B's attention and MLP, Qwen3-30B-A3B's experts (8 of its 128: the expert count is no constexpr).
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
EXPERTS, TOP_K, MOE_HIDDEN, MOE_UNITS = 8, 8, 2048, 768
BLOCK_SIZE = 16
HALVES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Launch:
    """One recorded `kernel[grid](*args, **kwargs)` and the case that made it."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    case: str


def record(cases: dict[str, Callable[[], object]]) -> list[Launch]:
    """Runs each case with JITFunction.run replaced: every launch is kept under its case's name, none runs."""
    launches = []
    for case, call in cases.items():
        with mock.patch.object(JITFunction, "run", _keeper(launches, case)):
            call()
    return launches


def _keeper(launches: list[Launch], case: str) -> Callable[..., None]:
    def run(kernel, *args, grid, warmup, **kwargs):
        launches.append(Launch(kernel, args, kwargs, case))

    return run


def fp8_cases() -> dict[str, Callable[[], object]]:
    """kernels/triton_fp8.py: the quantizer per token and per group, and the block product at decode and prefill
    sizes (both tile choices), in either half output, with and without bias, on 128x128 tiles and on ragged ones
    (shapes no multiple of the tile, and narrow tiles)."""
    from kernels.formats import MIN_BLOCK_STEP
    from kernels.triton_fp8 import block_scaled_mm, quantize_per_token

    def quantize(dtype, group):
        return lambda: quantize_per_token(torch.randn(4, HIDDEN, dtype=dtype), group)

    def product(m, n, k, dtype, bias, block=(128, 128)):
        def case():
            x, w = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(n, k, dtype=torch.float8_e4m3fn)
            x_scale = torch.ones(m, triton.cdiv(k, block[1]))
            w_scale = torch.ones(triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
            block_scaled_mm(x, x_scale, w, w_scale, block, torch.zeros(n, dtype=dtype) if bias else None, dtype)

        return case

    cases = {f"quantize per token {d}": quantize(d, None) for d in (*HALVES, torch.float32)}
    cases |= {f"quantize per 128 {d}": quantize(d, 128) for d in (*HALVES, torch.float32)}
    return cases | {
        "block mm decode bf16 bias": product(4, 6144, HIDDEN, torch.bfloat16, True),
        "block mm prefill bf16": product(256, 6144, HIDDEN, torch.bfloat16, False),
        "block mm prefill fp16 bias": product(256, 6144, HIDDEN, torch.float16, True),
        "block mm decode fp16": product(4, 6144, HIDDEN, torch.float16, False),
        "block mm ragged decode bf16 bias": product(3, 1000, 1000, torch.bfloat16, True),
        # Tiles whose columns allow only the narrowest step kernels/fp8.py's block_unsupported accepts.
        f"block mm ragged prefill bf16, 32x{3 * MIN_BLOCK_STEP} tiles": product(
            100, 1000, 1000, torch.bfloat16, False, (32, 3 * MIN_BLOCK_STEP)
        ),
    }


def moe_cases() -> dict[str, Callable[[], object]]:
    """kernels/triton_moe.py: the experts' op plain, with FP8 experts per row and per 128x128 tile, and with a
    rank's slice of the experts; its quantization and SiLU go through their CUDA kernels, as on a GPU. And
    kernels/triton_route.py's router top-k, of Qwen3-30B-A3B's 128 experts and of an expert count no power of two."""
    from kernels import triton_fp8, triton_fused, triton_moe, triton_route

    def experts(dtype, scales=None, first_expert=None):
        def case():
            tokens = 4
            x = torch.randn(tokens, MOE_HIDDEN, dtype=dtype)
            w13 = torch.zeros(EXPERTS, 2 * MOE_UNITS, MOE_HIDDEN, dtype=dtype)
            w2 = torch.zeros(EXPERTS, MOE_HIDDEN, MOE_UNITS, dtype=dtype)
            ids = torch.randint(0, 2 * EXPERTS if first_expert else EXPERTS, (tokens, TOP_K))
            fp8 = {}
            if scales is not None:
                block = None if scales == "rows" else (128, 128)
                fp8 = dict(w13_scale=_expert_scales(w13, block), w2_scale=_expert_scales(w2, block), block=block)
                w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
            with (
                mock.patch.object(triton_moe, "quantize_per_token", triton_fp8.quantize_per_token),
                mock.patch.object(triton_moe, "silu_and_mul", triton_fused.silu_and_mul),
            ):
                triton_moe.fused_moe(x, w13, w2, torch.rand(tokens, TOP_K), ids, first_expert, **fp8)

        return case

    return {
        "moe bf16": experts(torch.bfloat16),
        "moe fp32 (ieee dot)": experts(torch.float32),
        "moe expert-parallel bf16": experts(torch.bfloat16, first_expert=EXPERTS),
        "moe fp8 per row bf16": experts(torch.bfloat16, "rows"),
        "moe fp8 per 128x128 tile bf16": experts(torch.bfloat16, "tiles"),
        "moe fp8 per 128x128 tile expert-parallel fp16": experts(torch.float16, "tiles", EXPERTS),
        "route bf16, 128 experts top-8": lambda: triton_route.route(torch.randn(4, 128, dtype=torch.bfloat16), 8, True),
        "route fp32, 60 experts top-2": lambda: triton_route.route(torch.randn(4, 60), 2, False),
        # The one program's largest: 4,096 pairs sorted at once, 258 groups' histogram (its shared memory).
        "align, 512 tokens of top-8 over 128 experts": lambda: triton_moe.align(
            torch.randint(0, 128, (512, TOP_K)), 128, None, 16
        ),
        "align, one token of top-1 over 8 experts": lambda: triton_moe.align(torch.tensor([[3]]), 8, None, 16),
    }


def _expert_scales(w: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """Float32 scales of experts w [E, N, K]: [E, N] per row, [E, ceil(N / rows), ceil(K / cols)] per tile."""
    e, n, k = w.shape
    if block is None:
        return torch.ones(e, n)
    return torch.ones(e, triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))


def fused_cases() -> dict[str, Callable[[], object]]:
    """kernels/triton_fused.py: RMSNorm with and without the residual, SiLU-and-product, RoPE with the KV store
    into bf16 and FP8 pages, with and without Qwen3's q/k norm."""
    from kernels.triton_fused import rms_norm, rotary_store_kv, silu_and_mul

    def norm(dtype, residual):
        x, weight = torch.randn(4, HIDDEN, dtype=dtype), torch.ones(HIDDEN, dtype=dtype)
        return lambda: rms_norm(x, weight, 1e-5, torch.randn(4, HIDDEN, dtype=dtype) if residual else None)

    def rotary(dtype, cache_dtype, qk_norm):
        def case():
            tokens = 4
            qk = torch.randn(tokens, HEADS + KV_HEADS, HEAD_DIM, dtype=dtype)
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
            cos, sin = (torch.randn(tokens, 1, HEAD_DIM // 2, dtype=dtype) for _ in range(2))
            cache = torch.zeros(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
            norms = (torch.ones(HEAD_DIM, dtype=dtype), torch.ones(HEAD_DIM, dtype=dtype), 1e-6) if qk_norm else None
            rotary_store_kv(qk, v, cos, sin, cache, torch.arange(tokens), 0.5, 0.5, norms)

        return case

    cases = {f"rms_norm {d}": norm(d, False) for d in (*HALVES, torch.float32)}
    cases |= {f"add_rms_norm {d}": norm(d, True) for d in (*HALVES, torch.float32)}
    cases |= {f"silu_and_mul {d}": lambda d=d: silu_and_mul(torch.randn(4, 2 * INTERMEDIATE, dtype=d)) for d in HALVES}
    return cases | {
        "rotary_store_kv bf16": rotary(torch.bfloat16, torch.bfloat16, False),
        "rotary_store_kv fp16, q/k norm": rotary(torch.float16, torch.float16, True),
        "rotary_store_kv bf16, q/k norm": rotary(torch.bfloat16, torch.bfloat16, True),
        "rotary_store_kv bf16 into fp8": rotary(torch.bfloat16, torch.float8_e4m3fn, False),
        "rotary_store_kv bf16 into fp8, q/k norm": rotary(torch.bfloat16, torch.float8_e4m3fn, True),
    }


def lora_cases() -> dict[str, Callable[[], object]]:
    """kernels/triton_lora.py: Llama-3-8B's fused q/k/v (3 outputs), gate/up (2) and down (1, K the MLP's width)
    layers' adapters at rank 16 in either half, q/k/v in fp32 (the ieee dot the CUDA tests run), at rank 64 and at
    vLLM's largest rank, 512, in fp32 (the most shared memory a tile takes); a decode step of 40 tokens whose
    tiles mix two adapters and the base model."""
    from kernels.triton_lora import triton_add_lora

    layers = {
        "q/k/v": (HIDDEN, (HIDDEN, 1024, 1024)),
        "gate/up": (HIDDEN, (INTERMEDIATE,) * 2),
        "down": (INTERMEDIATE, (HIDDEN,)),
    }

    def case(layer, dtype, rank=16):
        def run():
            k, outs = layers[layer]
            slots = torch.tensor([0] * 20 + [-1] * 4 + [1] * 16)
            y = torch.zeros(len(slots), sum(outs), dtype=dtype)
            lora_a = torch.zeros(2, len(outs) * rank, k, dtype=dtype)
            lora_bs = [torch.zeros(2, rank, n, dtype=dtype) for n in outs]
            offsets = [sum(outs[:j]) for j in range(len(outs))]
            triton_add_lora(y, torch.randn(len(slots), k, dtype=dtype), lora_a, lora_bs, offsets, slots)

        return run

    cases = {f"lora {layer} {d}": case(layer, d) for layer in layers for d in HALVES}
    return cases | {
        "lora q/k/v fp32 (ieee dot)": case("q/k/v", torch.float32),
        "lora q/k/v bf16, rank 64": case("q/k/v", torch.bfloat16, 64),
        "lora q/k/v fp32, rank 512 (the widest: its dots cut to fit shared memory)": case("q/k/v", torch.float32, 512),
    }


def attention_cases() -> dict[str, Callable[[], object]]:
    """kernels/triton_attention.py: the KV store, and paged attention for a mixed prefill and decode step, a short
    decode step (unsplit), a long one (split and merged), a sliding window, and FP8 pages; batches built as the
    interpreter tests build them (tests/kernels/reference.py)."""
    from kernels.triton_attention import TritonBackend
    from tests.kernels.reference import make_batch, to_fp8

    mixed = ([1, 12, 1, 7, 21], [45, 12, 17, 30, 21])
    short_decode = ([1] * 5, [1, 8, 9, 31, 70])
    long_decode = ([1] * 4, [1100, 513, 7, 1024])

    def attention(lens, dtype=torch.bfloat16, window=None, fp8=False, head_dim=HEAD_DIM, kv_heads=KV_HEADS, group=4):
        def case():
            backend = TritonBackend()
            batch = make_batch(
                *lens, block_size=BLOCK_SIZE, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype
            )
            if fp8:
                batch, _ = to_fp8(batch, 0.5, 0.5)
            backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), 0.1, window, 0.5, 0.5)

        return case

    def store(cache_dtype):
        k, v = (torch.randn(4, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        cache = torch.zeros(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
        return lambda: TritonBackend().store_kv(k, v, cache, torch.arange(4), 0.5, 0.5)

    return {
        "store_kv bf16": store(torch.bfloat16),
        "store_kv fp8": store(torch.float8_e4m3fn),
        "attention mixed bf16": attention(mixed),
        "attention mixed fp16": attention(mixed, torch.float16),
        "attention mixed fp32 (ieee dot)": attention(mixed, torch.float32),
        "attention mixed bf16, head_dim 64, group 3 (SmolLM2)": attention(mixed, head_dim=64, kv_heads=3, group=3),
        "attention decode bf16": attention(short_decode),
        "attention split decode bf16": attention(long_decode),
        "attention mixed bf16, window": attention(mixed, window=40),
        "attention split decode bf16, window": attention(long_decode, window=600),
        "attention mixed bf16, fp8 pages": attention(mixed, fp8=True),
        "attention decode bf16, fp8 pages": attention(short_decode, fp8=True),
        "attention split decode bf16, fp8 pages": attention(long_decode, fp8=True),
    }


def all_cases() -> dict[str, Callable[[], object]]:
    return fp8_cases() | moe_cases() | fused_cases() | lora_cases() | attention_cases()


def specialise(launch: Launch, target: GPUTarget) -> tuple[dict, dict, dict, dict]:
    """(options, signature, constexprs, attrs) of the launch on `target`, exactly as JITFunction.run derives them
    (Triton 3.7's binder and _pack_args): pointer and int alignment attributes included, so that the variant
    compiled is the one a GPU would compile."""
    kernel, backend = launch.kernel, make_backend(target)
    kwargs = dict(
        launch.kwargs,
        debug=launch.kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug,
        instrumentation_mode=triton.knobs.compilation.instrumentation_mode,
    )
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return options.__dict__, signature, constexprs, attrs


def uses_fp8(launch: Launch) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES for a in (*launch.args, *launch.kwargs.values()))


@dataclass(frozen=True, slots=True)
class Variant:
    """One launch specialised for one arch: what Triton compiles once and caches."""

    launch: Launch
    arch: int
    spec: tuple[dict, dict, dict, dict]

    @property
    def name(self) -> str:
        return self.launch.kernel.fn.__name__


def variants(launches: list[Launch], archs: list[int]) -> list[Variant]:
    """The distinct variants of `launches` on each arch, float8 ones on archs >= 8.9 only."""
    found: dict[tuple, Variant] = {}
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for launch in launches:
            if arch >= FP8_MIN_ARCH or not uses_fp8(launch):
                spec = specialise(launch, target)
                found.setdefault((launch.kernel, arch, repr(spec)), Variant(launch, arch, spec))
    return list(found.values())


# Filled before the workers fork: they inherit the launches (tensors, kernels) rather than unpickle them.
_VARIANTS: list[Variant] = []


def compile_variant(index: int) -> tuple[float, str | None]:
    """Compiles _VARIANTS[index] to a cubin: (seconds, the error or None). Too much shared memory is an error:
    the launch would fail."""
    variant = _VARIANTS[index]
    options, signature, constexprs, attrs = variant.spec
    source = ASTSource(variant.launch.kernel, signature, constexprs, attrs)
    start = time.perf_counter()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", variant.arch, 32), options=options)
    except Exception as e:  # whatever the compiler raises is the finding
        return time.perf_counter() - start, f"{type(e).__name__}: {e}"
    shared, limit = compiled.metadata.shared, MAX_SHARED[variant.arch]
    error = f"needs {shared} bytes of shared memory, sm{variant.arch} allows {limit}" if shared > limit else None
    return time.perf_counter() - start, error


def compile_all(found: list[Variant], jobs: int) -> list[str]:
    """Compiles every variant, `jobs` at a time, printing a line for each in order; returns the failures."""
    _VARIANTS[:] = found
    failures = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for variant, (seconds, error) in zip(found, pool.map(compile_variant, range(len(found)))):
            status = "ok" if error is None else "FAIL"
            print(f"{status:4} sm{variant.arch} {variant.name:28} {seconds:5.2f}s  {variant.launch.case}", flush=True)
            if error is not None:
                failures.append(f"{variant.name} sm{variant.arch} ({variant.launch.case}): {error}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(MAX_SHARED), help="sm version (repeat)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at a time")
    args = parser.parse_args(argv)
    archs = args.arch or list(DEFAULT_ARCHS)
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: the kernels are interpreted, not compiled; run without it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    launches = record(all_cases())
    # A fresh cache: every variant compiles now, none is a hit from an earlier source.
    with tempfile.TemporaryDirectory(prefix="raylm-triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        found = variants(launches, archs)
        failures = compile_all(found, args.jobs)
    kernels = len({launch.kernel for launch in launches})
    print(
        f"{len(found)} variants of {kernels} kernels ({len(launches)} launches) for "
        f"{', '.join(f'sm{a}' for a in archs)}: {len(failures)} failed, {time.perf_counter() - start:.0f}s"
    )
    for failure in failures:
        print(f"\nFAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
