"""Quantized checkpoints: a Hugging Face `quantization_config` resolved per layer, and FP8 weights read through
their scales.

Two forms of FP8 weights load: `quant_method: fp8` (transformers' fine-grained FP8 and vLLM's: per tensor with
`weight_scale`, or per `weight_block_size` tile with `weight_scale_inv`, as Qwen3-FP8 and DeepSeek-V3 publish)
and compressed-tensors' float 8-bit weights (`weight_scale` per tensor, per output channel or per
`block_structure` tile). Either way a weight is float8_e4m3fn and its real value is the stored value times its
scale: `weight_scale_inv` is multiplied too, despite its name (it is the inverse of the factor the weight was
multiplied by when quantized). Every other method is refused by name: a quantized weight is never read as if it
were a plain one.

Activations are quantized dynamically, per token as they come (fp8's `activation_scheme: dynamic`;
compressed-tensors' `input_activations` float 8-bit and dynamic, or none), or statically (`activation_scheme:
static`; `input_activations` float 8-bit, `dynamic: false`, strategy `tensor`) with one fixed scale per layer, the
checkpoint's `<layer>.input_scale` (one float32 element, whole on every tensor-parallel rank; missing, mis-shaped
or not positive, refused naming it): x / scale in fp32, clamped to +-448, float8_e4m3fn. A fused layer (q/k/v,
gate/up) takes the largest of its parts' scales (its one input is quantized once), and is refused where only some
parts are static. A MoE block's experts take the largest of their experts' scales for each of their two products
(`SparseMoeBlock`: the grouped products quantize their whole input at once), and are refused where only some are
static or under expert parallel (a rank holds only its experts' scales). Refused by name: any other input
activations (integer, other widths, asymmetric, static per token or channel), static ones with block weights, and
static scales on routers or the LM head (plain products).

`--quantization fp8` (vLLM's flag) quantizes a plain checkpoint at load as vLLM's dynamic FP8 does, per output
channel: each row of each linear weight (not the embeddings, the LM head or the norms) becomes float8_e4m3fn with
a float32 scale, its largest magnitude / 448. On a checkpoint that is already `fp8` the flag changes nothing; on
one quantized by another method it is refused, naming both.

The weights are dequantized at load, on every device, into the model's compute dtype. On CPU they stay so: FP8's
numerics at bf16's (or fp32's) memory and speed, dynamic activations left unquantized, static ones still rounded
through FP8 at their scale before each product (`round_per_tensor`: a GPU's activations).

On a CUDA GPU of compute capability 8.9 or above, once the model is loaded (and its LoRA slots made, in the model's
dtype), `fp8_products` makes every linear layer whose checkpoint modules are quantized an FP8 one, layer by layer,
its products W8A8 (kernels/fp8.py): half the bytes a decode step reads. Its weight is requantized from the
dequantized one as the checkpoint laid it out, so a checkpoint's own FP8 values come back:
- per tensor, per channel, or by `--quantization fp8`: per output row (`quantize_rows`, each row at the scale the
  checkpoint stored it with, a per-tensor one's repeated over its rows, so that its values come back exactly),
  float32 scales [out], activations quantized per token (static ones per tensor, their scale repeated over the
  rows), one `torch._scaled_mm` with row-wise scales. A row-parallel rank's columns keep their whole rows' scales
  (the checkpoint's, or under `--quantization fp8` their maxima reduced over the tensor-parallel group), so the
  ranks together hold what one rank would;
- per block (Qwen3-FP8's and DeepSeek-V3's 128x128 tiles): per tile (`quantize_tiles`), float32 scales
  [out / rows, in / cols], activations quantized per token and group of `cols` columns, a Triton kernel.
Kept dequantized, and logged once with why: a fused layer (qkv_proj, gate_up_proj) one of whose checkpoint modules
the config leaves plain or lays out otherwise; a row-wise layer whose dimensions are not multiples of 16; a block
layer whose tensor-parallel slice (or fused part) starts or ends inside a tile, or whose tile's columns the kernel
cannot step through; and every layer on a GPU below 8.9, or where this build's `_scaled_mm` refuses the model's
dtype (fp32, on older builds fp16) or the block kernel fails to compile. The ranks of a tensor-parallel group
agree on those probes. A MoE block's experts become FP8 alike (`SparseMoeBlock.to_fp8`), all of them in one layout:
per expert and output row (float32 scales [E_local, rows], any shape) or per tile of each expert's matrix, their
products W8A8 in raylm's Triton grouped matmul (kernels/triton_moe.py); kept dequantized, and logged with why, where
a checkpoint module feeding them is plain or laid out otherwise, where this rank's units cut the tiles
(`SparseMoeBlock.tiles_cut`), or where the tile's columns are ones the kernel cannot step through. The embeddings,
the LM head and the routers are never FP8: dequantized in the model's dtype. Untested on a GPU
(tests/gpu/test_fp8.py; the experts' kernel has run only under Triton's interpreter; static activations have run
only through torch's CPU `_scaled_mm`).

The package's modules, one job each: `config.py` (the config resolved per layer), `checkpoint.py` (weights read
through their scales), `conversion.py` (FP8 products from the loaded weights).
"""
