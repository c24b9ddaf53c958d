"""What the torch and Triton paths of the kernels share, importing no kernel (so that a Triton module and the
module that dispatches to it never import each other): FP8's number format and the block layout's step through K,
and the dtypes the Triton kernels take."""

from __future__ import annotations

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# A row of zeros still gets a scale to divide by; real activations are never this small.
MIN_SCALE = 1e-12
# The block kernel steps through K in powers of two that divide a tile's columns; a GPU's 8-bit tl.dot takes K >= 32
# (Triton's NVIDIA backend; its interpreter takes 16).
MIN_BLOCK_STEP = 32
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block_step(cols: int) -> int:
    """The block kernel's step through K for tiles of `cols` columns: the largest power of two dividing it, at most
    128, so that no step straddles two tiles' scales."""
    return min(cols & -cols, 128)


def block_unsupported(block: tuple[int, int]) -> str | None:
    """Why the block kernel cannot take [rows, cols] tiles, or None."""
    if block_step(block[1]) < MIN_BLOCK_STEP:
        return (
            f"the FP8 block kernel steps through a tile's columns in powers of two of at least {MIN_BLOCK_STEP} "
            f"that divide them, and {block[1]} has none"
        )
    return None
