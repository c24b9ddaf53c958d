"""The CUDA path of the experts' op (device-side alignment, the Triton grouped matmul over a fixed grid) against
torch's (the CPU path), under the Triton interpreter on CPU; and the alignment reads nothing back to the host.
FP8 experts likewise: the grouped matmul against float64 products of the values its FP8 operands stand for, the
op against the torch path's FP8 numerics (tests/kernels/test_moe.py holds those to a float64 reference)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates, so before triton's first import.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import moe, triton_moe  # noqa: E402
from kernels.moe import _grouped, looped_moe  # noqa: E402
from tests.kernels.test_moe import FP8_LAYOUTS, fp8_experts, quantized  # noqa: E402

E, H, UNITS = 8, 32, 24  # experts, hidden size, units per expert
# The interpreter multiplies bfloat16's bit patterns in tl.dot (triton-lang/triton#11584): fp16 stands in there.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize(
    "counts",
    [[1, 0, 0, 0], [0, 70, 0, 3], [5, 33, 0, 40], [0, 0, 0, 0]],
    ids=["one token", "one expert takes most, two none", "uneven, tiles past a group's end", "no tokens"],
)
def test_grouped_mm_matches_torch(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 48, generator=g)
    w = torch.randn(len(counts), 80, 48, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    expected = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).unsqueeze(1)  # already sorted
    tiles = triton_moe.align(ids.to(DEVICE), len(counts), None)
    out = triton_moe.grouped_mm(x.to(DEVICE), w.to(DEVICE), tiles).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "block",
    [None, (32, 32), (16, 64)],
    ids=["rows", "32x32 blocks, ragged at both ends", "16x64 blocks, 2 steps of 32 per tile, ragged"],
)
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [5, 0, 33, 0]], ids=["one token", "groups of 0 rows"])
def test_fp8_grouped_mm_sums_the_values_its_operands_stand_for(counts, block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 80, generator=g)
    w, w_scale, w_values = fp8_experts(torch.randn(len(counts), 72, 80, generator=g), block)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).unsqueeze(1)  # already sorted
    tiles = triton_moe.align(ids.to(DEVICE), len(counts), None)
    config = triton_moe.TileConfig()
    out = triton_moe.grouped_mm(x.to(DEVICE), w.to(DEVICE), tiles, config, w_scale.to(DEVICE), block).cpu()
    x_values, ends = quantized(x, None if block is None else block[1]), torch.tensor(counts).cumsum(0).tolist()
    expected = torch.cat([x_values[end - n : end] @ w_values[e].T for e, (n, end) in enumerate(zip(counts, ends))])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


ALIGNERS = {"one program": triton_moe._align_one_program, "torch's sort": triton_moe._align_sorting}


@pytest.mark.parametrize("aligner", ALIGNERS.values(), ids=ALIGNERS)
def test_tiles_cover_each_group_once_and_mark_the_rest(aligner):
    ids = torch.tensor([[3], [0], [3], [9], [3], [0]])  # expert 9 is another rank's (first_expert 2: local 1, 7)
    # min(6 pairs, cdiv(6, 2) + 4 groups) = 6 tiles: expert 0's rows 0-1, expert 3's 2-3 and 4, then 3 unused.
    tiles = aligner((ids + 2).to(DEVICE), 4, 2, 2, 6)
    assert tiles.pairs.tolist() == [1, 5, 0, 2, 4, 3]
    assert tiles.group_end.tolist() == [2, 2, 2, 5]
    assert tiles.tile_group.tolist() == [0, 3, 3, 4, 4, 4]
    assert tiles.tile_row.tolist()[:3] == [0, 2, 4]


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "first_expert", "rows"),
    [(1, 8, 128, None, 16), (37, 2, 8, None, 32), (64, 8, 60, None, 16), (33, 4, 16, 8, 16), (512, 8, 128, 64, 64)],
    ids=["decode of one, 128 experts", "Mixtral's top-2", "60 experts", "expert parallel", "a graph's largest"],
)
def test_one_program_lays_out_the_tiles_torchs_sort_does(tokens, top_k, experts, first_expert, rows):
    """The alignment a decode's graph launches against the one a prefill runs: the same pairs in the same order,
    the same groups and the same real tiles (past them, only the group matters: their programs return)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    num_local = experts if first_expert is None else experts - first_expert
    n = ids.numel()
    max_tiles = min(n, -(-n // rows) + num_local)
    one, sorting = (a(ids, num_local, first_expert, rows, max_tiles) for a in ALIGNERS.values())
    assert torch.equal(one.pairs, sorting.pairs) and torch.equal(one.group_end, sorting.group_end)
    assert torch.equal(one.tile_group, sorting.tile_group)
    real = sorting.tile_group < num_local
    assert torch.equal(one.tile_row[real], sorting.tile_row[real])
    assert int(real.sum()) == sum(-(-int(c) // rows) for c in torch.diff(sorting.group_end, prepend=torch.zeros(1)))


def moe_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * UNITS, H, generator=g) * 0.3).to(dtype), (
        torch.randn(E, H, UNITS, generator=g) * 0.3
    ).to(dtype)


def routing(tokens: int, top_k: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    choices = torch.tensor(experts)
    ids = torch.stack([choices[torch.randperm(len(experts), generator=g)[:top_k]] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g), ids


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize(
    "tokens, experts", [(1, range(E)), (5, [0, 1, 3, 4, 5, 7]), (40, range(E))], ids=["one", "empty experts", "many"]
)
@pytest.mark.parametrize("first_expert", [None, 0, 4], ids=["all experts", "ep rank 0", "ep rank 1"])
def test_aligned_moe_matches_the_loop(tokens, experts, first_expert, dtype):
    w13, w2 = moe_weights(dtype)
    if first_expert is not None:  # expert parallel over two ranks: this one holds 4 experts whole
        w13, w2 = w13[first_expert : first_expert + 4], w2[first_expert : first_expert + 4]
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    topk_weights, topk_ids = routing(tokens, 2, list(experts))
    expected = looped_moe(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, first_expert)
    out = triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), first_expert)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("block", FP8_LAYOUTS.values(), ids=FP8_LAYOUTS)
@pytest.mark.parametrize(
    "tokens, experts, first_expert",
    [(1, range(E), None), (5, [0, 1, 3, 4, 5, 7], 4), (40, range(E), None)],
    ids=["one", "ep rank 1, an expert without tokens", "many"],
)
def test_fp8_moe_matches_the_torch_path(tokens, experts, first_expert, block, dtype):
    local = slice(first_expert or 0, (first_expert or 0) + (E if first_expert is None else 4))
    (w13, w13_scale, _), (w2, w2_scale, _) = (fp8_experts(w[local], block) for w in moe_weights(torch.float32))
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    topk_weights, topk_ids = routing(tokens, 2, list(experts))
    expected = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    args = (t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids))
    scales = {"w13_scale": w13_scale.to(DEVICE), "w2_scale": w2_scale.to(DEVICE), "block": block}
    out = triton_moe.fused_moe(*args, first_expert, **scales)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("fp8", [False, True], ids=["plain experts", "FP8 experts"])
@pytest.mark.parametrize("tokens, first_expert", [(1, None), (40, None), (5, 4)], ids=["one", "many", "ep rank 1"])
def test_static_input_scales_match_the_torch_path(tokens, first_expert, fp8, dtype):
    """A static checkpoint's experts: each product's input quantized (or, before plain weights, rounded) with its
    one fixed scale, the first product's small enough that the largest tokens saturate."""
    local = slice(first_expert or 0, (first_expert or 0) + (E if first_expert is None else 4))
    (w13, w13_scale, w13_values), (w2, w2_scale, w2_values) = (
        fp8_experts(w[local], None) for w in moe_weights(torch.float32)
    )
    if not fp8:
        w13, w2, w13_scale, w2_scale = w13_values.to(dtype), w2_values.to(dtype), None, None
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    topk_weights, topk_ids = routing(tokens, 2, list(range(E)))
    input_scales = (torch.tensor(float(x.abs().max()) / 448 * 0.8), torch.tensor(0.002))
    expected = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, None, *input_scales)
    args = (t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids))
    scales = {"w13_scale": w13_scale, "w2_scale": w2_scale}
    on_device = {k: None if v is None else v.to(DEVICE) for k, v in scales.items()}
    out = triton_moe.fused_moe(*args, first_expert, **on_device, input_scales=tuple(s.to(DEVICE) for s in input_scales))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol)


def test_other_ranks_rows_never_reach_the_output(monkeypatch):
    """Rows no tile covers hold whatever the buffer held: NaN here, which a multiplication by 0 would keep."""
    grouped_mm = triton_moe.grouped_mm

    def garbage_in_uncovered_rows(x, w, tiles, config, *fp8, **kwargs):
        out = grouped_mm(x, w, tiles, config, *fp8, **kwargs)
        if "pair_weights" in kwargs:
            return out
        # Local groups first, other ranks' pairs after the last one's end.
        uncovered = torch.arange(out.shape[0], device=out.device) >= tiles.group_end[-1]
        return out.masked_fill(uncovered.unsqueeze(1), torch.nan)

    monkeypatch.setattr(triton_moe, "grouped_mm", garbage_in_uncovered_rows)
    w13, w2 = (w[4:] for w in moe_weights(torch.float32))
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(6, 3, list(range(E)))
    out = triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), 4)
    torch.testing.assert_close(out.cpu(), looped_moe(x, w13, w2, topk_weights, topk_ids, 4))


class NoHostReads(TorchDispatchMode):
    """Raises on the ops that read a tensor back to the host or return a shape that depends on its values, and on
    the Python conversions that read one (`int(t)`, `float(t)`, `bool(t)`, `t.tolist()`, ...): on a CPU tensor
    those read its memory without dispatching any op, so the mode alone would not see them."""

    READS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name in self.READS:
            setattr(torch.Tensor, name, self._refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    @staticmethod
    def _refuse(name: str):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} reads a tensor on the host")

        return read

    BANNED = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.repeat_interleave.Tensor,
        torch.ops.aten.masked_select.default,
        torch.ops.aten._unique.default,
        torch.ops.aten._unique2.default,
        torch.ops.aten.unique_dim.default,
        torch.ops.aten.unique_consecutive.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if func in self.BANNED or bool_index:
            raise AssertionError(f"{func} reads the host or makes a data-dependent shape")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("first_expert", [None, 4])
def test_the_op_reads_nothing_on_the_host(first_expert):
    local = slice(first_expert or 0, (first_expert or 0) + 4)
    w13, w2 = (w[local] for w in moe_weights(torch.float32))
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(9, 3, list(range(E if first_expert else 4)))
    args = [t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)]
    with NoHostReads():
        tiles = triton_moe.align(args[-1], 4, first_expert)
        out = triton_moe.fused_moe(*args, first_expert)
    assert tiles.tile_group.shape == (min(27, 1 + 4),)  # the grid: from shapes only
    torch.testing.assert_close(out.cpu(), looped_moe(x, w13, w2, topk_weights, topk_ids, first_expert))
    with pytest.raises(AssertionError, match="nonzero"), NoHostReads():
        _grouped(topk_ids, topk_weights, 4, 4)  # the CPU path's grouping: the mode bites


class Launches:
    """A jitted kernel standing in for itself, noting its name at each launch."""

    def __init__(self, kernel, names: list[str]):
        self.kernel, self.names = kernel, names

    def __getitem__(self, grid):
        self.names.append(self.kernel.fn.__name__)
        return self.kernel[grid]


class TorchCompute(TorchDispatchMode):
    """Notes each torch op that computes something: not allocations and views, nor the copies and storage swaps of
    the interpreter's handling of a kernel's arguments (never issued on CUDA)."""

    QUIET = {"empty", "new_empty", "view", "set_", "copy_", "detach", "alias"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.QUIET:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("first_expert", [None, 4])
def test_a_decode_launches_the_alignment_two_products_and_one_sum(monkeypatch, first_expert):
    """What a captured decode replays for a MoE layer's experts: one kernel sorts and tiles the pairs, the first
    product reads each pair's token in place, the second writes each pair's weighted row where the token's sum
    reads it, and torch only sums over the choices (and zeroes other ranks' rows). Before, torch's sort,
    searches, index arithmetic, gathers and scatter-add came to about thirty launches."""
    names: list[str] = []
    for kernel in ("_align_kernel", "_grouped_mm_kernel"):
        monkeypatch.setattr(triton_moe, kernel, Launches(getattr(triton_moe, kernel), names))
    local = slice(first_expert or 0, (first_expert or 0) + 4)
    w13, w2 = (w[local] for w in moe_weights(torch.float32))
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(3, 2, list(range(E if first_expert else 4)))
    args = [t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)]
    with TorchCompute() as torch_ops:
        out = triton_moe.fused_moe(*args, first_expert)
    torch.testing.assert_close(out.cpu(), looped_moe(x, w13, w2, topk_weights, topk_ids, first_expert))
    assert names == ["_align_kernel", "_grouped_mm_kernel", "_grouped_mm_kernel"]
    silu = [] if DEVICE == "cuda" else ["raylm.silu_and_mul"]  # a Triton kernel on CUDA
    zeros = [] if first_expert is None else ["aten.new_zeros"]
    assert sorted(torch_ops.ops) == sorted([*silu, *zeros, "aten.sum"]), torch_ops.ops


def test_the_fp8_op_reads_nothing_on_the_host():
    (w13, w13_scale, _), (w2, w2_scale, _) = (fp8_experts(w[4:], (32, 32)) for w in moe_weights(torch.float32))
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(9, 3, list(range(E)))
    args = [t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)]
    with NoHostReads():
        out = triton_moe.fused_moe(
            *args, 4, w13_scale=w13_scale.to(DEVICE), w2_scale=w2_scale.to(DEVICE), block=(32, 32)
        )
    expected = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, 4, w13_scale, w2_scale, (32, 32))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """An empty folder of measured tables in place of the package's, and the tables' cache forgotten around."""
    monkeypatch.setenv("RAYLM_MOE_CONFIG_DIR", str(tmp_path))
    triton_moe._table.cache_clear()
    yield tmp_path
    triton_moe._table.cache_clear()


def record_configs(monkeypatch) -> list:
    """The TileConfig of each grouped matmul launched, as it happens."""
    seen, grouped_mm = [], triton_moe.grouped_mm

    def recorded(x, w, tiles, config, *fp8, **kwargs):
        seen.append(config)
        return grouped_mm(x, w, tiles, config, *fp8, **kwargs)

    monkeypatch.setattr(triton_moe, "grouped_mm", recorded)
    return seen


def test_a_measured_table_picks_the_tiles_nearest_the_steps_pair_count(config_dir, monkeypatch):
    small, large = triton_moe.TileConfig(16, 32, 16, 4, 2), triton_moe.TileConfig(64, 32, 32, 8, 3)
    w13, w2 = moe_weights(torch.float32)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    triton_moe.write_table(
        config_dir / triton_moe.config_name(E, H, UNITS, torch.float32, device), {2: small, 64: large}
    )
    seen = record_configs(monkeypatch)
    for tokens, expected_config in ((1, small), (40, large)):  # 2 and 80 pairs
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3))
        topk_weights, topk_ids = routing(tokens, 2, list(range(E)))
        out = triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)))
        torch.testing.assert_close(out.cpu(), looped_moe(x, w13, w2, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)
        assert seen[-2:] == [expected_config] * 2
    other = triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13[:4], w2[:4], topk_weights, topk_ids % 4)))
    assert other.shape == x.shape and seen[-1] == triton_moe.TileConfig()  # 4 experts: no table, the defaults


def test_a_malformed_table_is_an_error_naming_its_file(config_dir):
    w13, _ = moe_weights(torch.float32)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    name = triton_moe.config_name(E, H, UNITS, torch.float32, device)
    (config_dir / name).write_text('{"8": {"rows": 16, "colums": 32}}')
    with pytest.raises(ValueError, match=name.replace("(", r"\(").split(",")[0]):
        triton_moe.tile_config(8, w13.to(DEVICE))


@pytest.mark.parametrize(
    ("fp8", "block"), [(False, None), (True, None), (True, (16, 32))], ids=["plain", "fp8 rows", "fp8 16x32 tiles"]
)
def test_the_tuner_writes_the_fastest_candidate_per_step_size_for_the_op_to_read(config_dir, monkeypatch, fp8, block):
    """raylm bench moe --tune's table: the fastest candidate per pair count (a stand-in timer here, as the
    interpreter's times say nothing of a GPU's), which fused_moe then launches; FP8 experts' own table, named by
    their dtype and tile, read by FP8 experts of that layout only."""
    from bench.moe_tune import tune_tiles
    from kernels.fp8 import quantize_experts

    default, small = triton_moe.TileConfig(), triton_moe.TileConfig(16, 32, 32, 4, 2)  # an 8-bit dot needs K >= 32
    launched = record_configs(monkeypatch)

    def stand_in_timer(fn) -> float:
        """Small tiles win at 2 pairs (1 token), the defaults at 16 (8 tokens)."""
        fn()
        config, pairs = launched[-1], 2 if len(launched) <= 4 else 16
        return 1.0 if (config == small) == (pairs == 2) else 2.0

    path = tune_tiles(
        E, 2, H, UNITS, torch.float32, (1, 8), config_dir, stand_in_timer, [default, small], fp8=fp8, block=block
    )
    assert path.parent == config_dir and triton_moe._table(path.name) == ((2, small), (16, default))
    assert ("float8_e4m3fn" in path.name) == fp8 and ("16x32" in path.name) == (block is not None)
    w13, w2 = moe_weights(torch.float32)
    scales = {}
    if fp8:
        (w13, w13_scale), (w2, w2_scale) = quantize_experts(w13, block), quantize_experts(w2, block)
        scales = {"w13_scale": w13_scale.to(DEVICE), "w2_scale": w2_scale.to(DEVICE), "block": block}
    for tokens, expected in ((1, small), (8, default)):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(4))
        topk_weights, topk_ids = routing(tokens, 2, list(range(E)))
        launched.clear()
        triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), **scales)
        assert launched == [expected, expected]
    if fp8:  # experts of another layout have no table: the defaults
        other = None if block else (16, 32)
        (w13, w13_scale), (w2, w2_scale) = (quantize_experts(w.float(), other) for w in moe_weights(torch.float32))
        launched.clear()
        scales = {"w13_scale": w13_scale.to(DEVICE), "w2_scale": w2_scale.to(DEVICE), "block": other}
        triton_moe.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), **scales)
        assert launched == [default, default]
