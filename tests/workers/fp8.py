"""FP8 checkpoints made from a float one, quantized the way published checkpoints are (scale = the tile's largest
magnitude / 448, the stored weight = weight / scale in float8_e4m3fn), for the loader's tests; and, run as a
script, the quality of each scheme against the float model:

    python -m tests.workers.fp8 MODEL_DIR [--dtype bfloat16] [--products] [SCHEME ...]

prints, per scheme (the checkpoints'; quantization=fp8, raylm's `--quantization fp8`; kv_cache_dtype=fp8, its
`--kv-cache-dtype fp8`), the greedy agreement with the model in --dtype (default float32) over a few prompts, where
each prompt first diverges, and the mean absolute error of its logits (teacher-forced on the reference model's own
continuations). With --products the FP8 layers run FP8 products (W8A8, fp8_products), as a GPU runs them, rather
than the dequantized weights' products."""

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class Scheme:
    """A way to store a checkpoint's linear weights: `tile` (rows, cols) per scale, None for the whole weight and
    0 for a whole dimension (per channel: (1, 0)); the scale tensor's name and whether it is kept [out, 1] (per
    channel) or a 0-d scalar (per tensor). `static`: each layer also gets `input_scale`, its activations' one
    scale, calibrated (`calibrate`)."""

    config: dict[str, Any]
    tile: tuple[int, int] | None
    scale_name: str = "weight_scale"
    static: bool = False


# compressed-tensors' static FP8 activations (llm-compressor's FP8 preset): one calibrated scale per tensor.
STATIC_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def _ct(strategy: str, block: list[int] | None = None, activations: dict[str, Any] | None = None) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "block_structure": block}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}


SCHEMES = {
    "fp8 per tensor (static activations)": Scheme(
        {"quant_method": "fp8", "activation_scheme": "static"}, None, static=True
    ),
    "compressed-tensors per channel": Scheme({**_ct("channel"), "ignore": ["lm_head"]}, (1, 0)),
    "compressed-tensors per channel (static activations)": Scheme(
        {**_ct("channel", None, STATIC_ACTIVATIONS), "ignore": ["lm_head"]}, (1, 0), static=True
    ),
    "fp8 blocks 32x32": Scheme(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
        (32, 32),
        "weight_scale_inv",
    ),
    # 64 and 128 rows split into 48 + 16 and 48 + 48 + 32: ragged edge tiles, and tensor-parallel halves that
    # cut tiles.
    "compressed-tensors blocks 48x48 (ragged)": Scheme({**_ct("block", [48, 48]), "ignore": ["lm_head"]}, (48, 48)),
}
# The tiles Qwen3-FP8 and DeepSeek-V3 use, for a real model's shapes (the script's, not the tests').
PUBLISHED_BLOCKS = {
    "fp8 blocks 128x128": Scheme(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        (128, 128),
        "weight_scale_inv",
    )
}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What published FP8 checkpoints quantize: every linear layer's weight but the LM head's."""
    return name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name


def quantize(weight: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scales [ceil(out / rows), ceil(in / cols)], the float64 weight they stand for)."""
    rows, cols = weight.shape
    tr, tc = tile
    grid = (-(-rows // tr), -(-cols // tc))
    padded = torch.zeros(grid[0] * tr, grid[1] * tc, dtype=torch.float64)
    padded[:rows, :cols] = weight
    amax = padded.view(grid[0], tr, grid[1], tc).abs().amax(dim=(1, 3))
    scales = (amax.clamp(min=1e-12) / FP8_MAX).float()
    per_element = scales.double().repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:rows, :cols]
    stored = (weight.double() / per_element).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored, scales, stored.double() * per_element


def calibrate(src: str) -> dict[str, torch.Tensor]:
    """Each linear layer of the float checkpoint at `src` (transformers' nn.Linear modules but the LM head) -> its
    static input scale, made as llm-compressor makes one: the largest magnitude of its inputs over a few random
    sequences, / 448, float32 (sequences other than the tests', so that theirs may saturate now and then)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    amax: dict[str, float] = {}

    def record(name: str):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(record(name))
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for length in (8, 24):
            model(torch.randint(model.config.vocab_size, (1, length), generator=gen))
    return {name: torch.tensor(a / FP8_MAX, dtype=torch.float32) for name, a in amax.items()}


def write_fp8_checkpoint(src: str, dst: Path, scheme: Scheme) -> dict[str, torch.Tensor]:
    """The float checkpoint at `src` (one safetensors file) quantized by `scheme` into `dst`, with its
    quantization_config (and calibrated input scales where it is static: 0-d in fp8's form, [1] in
    compressed-tensors', as each publishes them); returns the float64 weights the new checkpoint stands for."""
    input_scales = calibrate(src) if scheme.static else {}
    one_element = scheme.config["quant_method"] == "compressed-tensors"
    dst.mkdir(parents=True, exist_ok=True)
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(src) / extra).is_file():
            shutil.copy(Path(src) / extra, dst / extra)
    config = json.loads((Path(src) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": scheme.config}))
    stored, real = {}, {}
    for name, weight in load_file(Path(src) / "model.safetensors").items():
        if not is_quantized(name, weight):
            stored[name], real[name] = weight, weight.double()
            continue
        tile = scheme.tile or weight.shape
        tile = tuple(size if t == 0 else t for t, size in zip(tile, weight.shape))
        stored[name], scales, real[name] = quantize(weight, tile)
        layer = name.removesuffix(".weight")
        stored[f"{layer}.{scheme.scale_name}"] = scales.reshape(()) if scheme.tile is None else scales
        if layer in input_scales:
            stored[f"{layer}.input_scale"] = input_scales[layer].reshape(1) if one_element else input_scales[layer]
    save_file(stored, dst / "model.safetensors")
    return real


def _logits(model: torch.nn.Module, tokens: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    from tests.workers.test_models import run_paged

    return run_paged(model, [tokens], ({0: len(tokens)},), kv_dtype)[0].float()


def quality(
    plain: torch.nn.Module,
    fp8: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[int, float, float, list]:
    """(prompts whose greedy continuation by `fp8` (its KV pages in `kv_dtype`, default its own dtype) equals the
    `plain` model's, mean |logit error| over the prompts and the plain model's continuations, the plain model's mean
    |logit| there, the first diverging step of each prompt or None)."""
    agree, errors, sizes, divergence = 0, [], [], []
    for prompt in prompts:
        ours, theirs = list(prompt), list(prompt)
        for _ in range(new_tokens):
            theirs.append(int(_logits(plain, theirs)[-1].argmax()))
            ours.append(int(_logits(fp8, ours, kv_dtype)[-1].argmax()))
        reference = _logits(plain, theirs)
        errors.append((_logits(fp8, theirs, kv_dtype) - reference).abs().mean().item())
        sizes.append(reference.abs().mean().item())
        diverged = [i for i in range(new_tokens) if ours[len(prompt) + i] != theirs[len(prompt) + i]]
        divergence.append(diverged[0] if diverged else None)
        agree += not diverged
    return agree, sum(errors) / len(errors), sum(sizes) / len(sizes), divergence


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


AT_LOAD = ("quantization=fp8", "kv_cache_dtype=fp8")


def main(model_dir: str, dtype: torch.dtype, names: list[str], products: bool = False) -> None:
    """The quality report of the module docstring; a model without a tokenizer gets 8 random 6-token prompts.
    `products`: the FP8 weights converted by fp8_products, so that the products are W8A8 as on a GPU (activations
    quantized too), not the dequantized weights' products."""
    from kernels import TorchBackend
    from workers.model_loader import load_model, read_model_spec
    from workers.quantization.conversion import fp8_products

    prompts = [torch.randint(100, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    schemes = {**SCHEMES, **PUBLISHED_BLOCKS}
    plain = load_model(model_dir, dtype, attn_backend=TorchBackend())
    for name in names or [*schemes, *AT_LOAD]:
        with tempfile.TemporaryDirectory() as dst:
            kv_dtype = torch.float8_e4m3fn if name == "kv_cache_dtype=fp8" else None
            quantization = "fp8" if name == "quantization=fp8" else None
            path = model_dir
            if name not in AT_LOAD:
                write_fp8_checkpoint(model_dir, Path(dst), schemes[name])
                path = dst
            model = load_model(path, dtype, attn_backend=TorchBackend(), quantization=quantization)
            weights = read_model_spec(path, quantization=quantization).quantization
            if products and weights is not None:
                name += f" (W8A8: {len(fp8_products(model, weights))} layers)"
            agree, error, size, divergence = quality(plain, model, prompts, 16, kv_dtype)
        print(
            f"{name} vs {dtype}: greedy {agree}/{len(prompts)} prompts equal over 16 tokens (first divergence "
            f"{divergence}), mean |logit error| {error:.4f} (mean |logit| {size:.2f})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FP8 schemes' quality against the plain model")
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("schemes", nargs="*", help=f"default: all ({[*SCHEMES, *PUBLISHED_BLOCKS, *AT_LOAD]})")
    parser.add_argument(
        "--products", action="store_true", help="FP8 products (W8A8, as on a GPU) rather than dequantized weights"
    )
    args = parser.parse_intermixed_args()
    main(args.model_dir, getattr(torch, args.dtype), args.schemes, args.products)
