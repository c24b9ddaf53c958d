"""tests/gpu: what only a GPU can check. Skipped without CUDA; run alone, on one GPU, without Ray:

    python -m pytest tests/gpu

Engines here use the in-process executor (the GPU machines we borrow have no Ray) and a small
gpu_memory_utilization unless the test is about memory, so tests can share the GPU one after another.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 comparisons with transformers need true fp32 matmuls: TF32 would round every product's inputs."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.cuda.empty_cache()
