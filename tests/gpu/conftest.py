"""tests/gpu: what only a GPU can check. Not collected without CUDA; run alone, on one GPU, without Ray:

    python -m pytest tests/gpu

Engines here use the in-process executor (the GPU machines we borrow have no Ray) and a small
gpu_memory_utilization unless the test is about memory, so tests can share the GPU one after another.
"""

import pytest
import torch


# Without CUDA the modules are not even imported: they import Triton compiled, which would stop the kernel
# tests of the CPU suite from running it under its interpreter.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 comparisons with transformers need true fp32 matmuls: TF32 would round every product's inputs."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.cuda.empty_cache()
