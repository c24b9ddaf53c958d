"""The fused elementwise CPU ops (kernels/cpu_ops.py) against the eager torch they replace, and the sampler's
categorical draw and top-p cut against their definitions, on the native path (fp32, built for this machine) and on
the fallback every other dtype and device takes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from kernels import cpu_ops
from kernels.cpu_ops import (
    _build_dir,
    add_rms_norm,
    load_cpu_ops,
    rotary_,
    sample_categorical,
    silu_and_mul,
    top_p_mask_,
)

DTYPES = [pytest.param(torch.float32, id="native"), pytest.param(torch.float64, id="fallback")]


def test_the_native_ops_build_here():
    assert load_cpu_ops(), "the native CPU ops did not build (see the logged warning)"


def test_a_build_killed_midway_does_not_stop_the_next_load(tmp_path):
    # This machine's built library in a cache of its own, with the `lock` file a killed build leaves behind.
    assert load_cpu_ops()
    built = Path(_build_dir())
    copy = tmp_path / built.relative_to(built.parents[1])
    shutil.copytree(built, copy)
    (copy / "lock").touch()
    probe = "from kernels.cpu_ops import load_cpu_ops; print(load_cpu_ops())"
    env = {**os.environ, "RAYLM_CACHE_DIR": str(tmp_path)}
    timeout_s = 120  # a load of the built library takes seconds
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading the native ops waited on a stale lock file for {timeout_s} s")
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_each_torch_install_builds_into_a_directory_of_its_own(tmp_path, monkeypatch):
    """A build names its torch's headers and libraries by path: two virtual environments sharing one directory
    would rebuild it each time the other had loaded it."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    here = _build_dir()
    assert _build_dir() == here
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/site-packages/torch/__init__.py")
    assert _build_dir() != here


def test_a_first_build_says_so_and_a_load_of_the_built_library_does_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: None)  # what it builds is not the point
    said = []
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    for _ in range(2):
        monkeypatch.setattr(cpu_ops, "_tried", False)
        assert cpu_ops.load_cpu_ops()
        said.append("raylm: building the native CPU ops" in capsys.readouterr().err)
        (Path(_build_dir()) / "raylm_cpu_ops.so").touch()  # as the build leaves it
    assert said == [True, False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_add_rms_norm_adds_in_place_and_normalises(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=g, dtype=dtype) for _ in range(2))
    weight = torch.randn(576, generator=g, dtype=dtype)
    expected_sum = residual + x
    out = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the same fp additions, in place
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 513])
def test_silu_and_mul(dtype, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows), dtype=dtype) * 6
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_a_strided_view_in_place_and_nothing_else(dtype):
    """q and k heads as the attention layer has them: the first 12 of 15 heads of each row of a fused qkv."""
    g = torch.Generator().manual_seed(0)
    t, d = 29, 64
    qkv = torch.randn(t, 15 * d, generator=g, dtype=dtype)
    before = qkv.clone()
    cos, sin = (torch.randn(t, 1, d // 2, generator=g, dtype=dtype) for _ in range(2))
    qk = qkv[:, : 12 * d].view(t, 12, d)
    x1, x2 = before[:, : 12 * d].view(t, 12, d).chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    rotary_(qk, cos, sin)
    torch.testing.assert_close(qkv[:, : 12 * d].view(t, 12, d), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 12 * d :], before[:, 12 * d :])  # v untouched


@pytest.mark.parametrize(
    "rows_per_group, n, k",
    [
        ([1, 0, 3, 13, 7], 48, 64),  # empty groups, rows past several tiles, a last tile of each size
        ([2, 5, 0, 1], 37, 29),  # columns past the 4-row blocks, a K that no vector width divides
        ([64], 8, 2048),  # one group of the most rows the MoE op hands it
    ],
)
def test_grouped_small_mm_multiplies_each_group_by_its_weight(rows_per_group, n, k):
    g = torch.Generator().manual_seed(len(rows_per_group))
    counts = torch.tensor(rows_per_group, dtype=torch.int32)
    offs = counts.cumsum(0, dtype=torch.int32)
    x = torch.randn(int(offs[-1]), k, generator=g)
    w = torch.randn(len(rows_per_group), n, k, generator=g)
    assert load_cpu_ops()
    expected = torch.cat([xg.double() @ wg.double().T for xg, wg in zip(x.split(rows_per_group), w)]).float()
    torch.testing.assert_close(torch.ops.raylm.grouped_small_mm(x, w, offs), expected, rtol=1e-5, atol=1e-4)


LAST_UNIFORM = 1 - 2**-53  # the largest float64 below 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_categorical_inverts_each_rows_cumulative_weights(dtype):
    """Weights 1, 2, 0, 3, 4 (total 10, not normalised): u picks the first token whose cumulative weight passes
    10u, and the weightless token 2 never."""
    uniforms = [0.0, 0.0999, 0.1001, 0.2999, 0.3001, 0.5999, 0.6001, 0.9, LAST_UNIFORM]
    weights = torch.tensor([[1.0, 2.0, 0.0, 3.0, 4.0]] * len(uniforms), dtype=dtype)
    drawn = sample_categorical(weights, torch.tensor(uniforms, dtype=torch.float64))
    assert drawn.dtype == torch.int64
    assert drawn.tolist() == [0, 0, 1, 1, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_categorical_crosses_blocks_and_never_draws_a_weightless_token(dtype):
    """1,000 tokens (several of the native op's blocks of 256) with weight at 5, 300 and 999 only; a row with
    one token of weight, at both ends of [0, 1); a row with none (every token masked) gives token 0."""
    weights = torch.zeros(7, 1000, dtype=dtype)
    weights[:4, [5, 300, 999]] = torch.tensor([1.0, 1.0, 2.0], dtype=dtype)
    weights[4:6, 700] = 1e-30
    uniforms = torch.tensor([0.2, 0.3, 0.49, 0.51, 0.0, LAST_UNIFORM, 0.5], dtype=torch.float64)
    assert sample_categorical(weights, uniforms).tolist() == [5, 300, 300, 999, 700, 700, 0]


def test_sample_categorical_native_and_fallback_agree_on_softmax_rows():
    """Rows as the sampler passes them (a softmax over 49,152 tokens, some masked), drawn natively and by the
    float64 cumsum the fallback takes: the same token for every uniform, and always one of positive weight."""
    assert load_cpu_ops()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 49152, generator=g) * 4
    logits[:, ::3] = float("-inf")
    probs = logits.softmax(-1)
    for _ in range(20):
        uniforms = torch.rand(16, dtype=torch.float64, generator=g)
        drawn = sample_categorical(probs, uniforms)
        assert torch.equal(drawn, sample_categorical(probs.double(), uniforms))
        assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all())


@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0])
def test_top_p_mask_native_and_fallback_keep_the_same_tokens(scale):
    """Vocabulary-sized rows from nearly flat to peaked, a seventh of each masked already: the radix select keeps
    exactly the tokens the sort keeps, top_p 1 keeps every unmasked token and a tiny top_p the top one."""
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(24, 49152, generator=g) * scale
    logits[:, ::7] = float("-inf")
    top_p = torch.rand(24, generator=g) * 0.98 + 0.01
    top_p[0], top_p[1] = 1.0, 1e-8
    native, fallback = logits.clone(), logits.double()
    top_p_mask_(native, top_p)
    top_p_mask_(fallback, top_p)
    kept = native > float("-inf")
    assert torch.equal(kept, fallback > float("-inf"))
    assert torch.equal(native[kept], logits[kept])  # what stays is untouched
    assert torch.equal(kept[0], logits[0] > float("-inf"))
    assert kept[1].sum() == 1 and kept[1, logits[1].argmax()]


def test_top_p_mask_native_keeps_ties_at_the_cut_together():
    # Probabilities 0.45, 0.16, 0.16, 0.16, 0.06: top_p 0.5 cuts inside the tie, which stays whole; a row of only
    # -inf (every token banned) is left as it is.
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0], [float("-inf")] * 5])
    top_p_mask_(logits, torch.tensor([0.5, 0.5]))
    assert (logits[0] > float("-inf")).tolist() == [True, True, True, True, False]
    assert torch.isneginf(logits[1]).all()
