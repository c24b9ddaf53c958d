"""The one list of each setting's choices, and the defaults more than one declaration needs."""

# workers.default_model.MODEL_NAME: the settings import nothing of workers/
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 8 << 20
GIB = 1 << 30
SCHEDULING_POLICIES = ("fcfs", "priority")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEVICES = ("auto", "cpu", "cuda")
# The settings name these without importing the layers that run them (torch): workers.worker.DTYPES maps each
# name to its torch dtype and kernels.BACKENDS is the attention backends' list (tests/engine/config/test_config.py
# checks that they agree).
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# The KV block size wherever flash-attn's pages are out of the question (kernels.DEFAULT_BLOCK_SIZE).
DEFAULT_BLOCK_SIZE = 16
# --quantization's methods, as vLLM names them (workers.quantization.config.AT_LOAD_METHODS).
QUANTIZATIONS = ("fp8",)
# --kv-cache-dtype's names, as vLLM's (fp8 and fp8_e4m3 both mean float8_e4m3fn pages: workers.worker.KV_DTYPES),
# and the attention backends that read FP8 pages (kernels/metadata.py says how; flash-attn 2 reads none).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("auto", "recompute", "swap")
REQUEST_ROUTERS = ("prefix_cache", "serve")
POOLING_TYPES = ("auto", "last", "mean")
RUNNERS = ("auto", "generate", "pooling")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# Proposed tokens per step at most: each one is a position the step computes for every speculating request,
# and the chance that a proposal's j-th token is accepted falls with j (the product of the chances before it).
MAX_SPECULATIVE_TOKENS = 16
