"""`raylm bench profile`: its analysis on hand-built events, one run on CPU, and its command line."""

import json
import re

import pytest

import cli
from bench import profile
from bench.profile import (
    between_steps,
    busy_and_idle,
    layer_slice,
    split_steps,
    step_profile,
    top_kernels,
)


def test_busy_time_is_the_union_of_the_intervals_and_idle_the_gaps_inside_their_span():
    # [0, 15) from two overlapping intervals, [12, 14) inside it, then a gap of 5 before [20, 25).
    assert busy_and_idle([(20, 5), (0, 10), (5, 10), (12, 2)]) == (20, 5)
    assert busy_and_idle([(0, 10), (10, 4)]) == (14, 0)  # touching: no gap
    assert busy_and_idle([]) == (0, 0)


def test_events_go_to_the_last_step_begun_before_them():
    events = [("early", 50, 1), ("a", 100, 1), ("b", 150, 1), ("c", 200, 1), ("late", 390, 1)]
    assert split_steps(events, [100, 200, 300]) == [
        [("a", 100, 1), ("b", 150, 1)],
        [("c", 200, 1)],
        [("late", 390, 1)],
    ]


def test_the_idle_between_steps_runs_from_one_steps_last_end_to_the_next_steps_first_start():
    steps = [
        [("a", 0, 30), ("b", 5, 10)],  # ends at 30, not at the last-starting event's end
        [("c", 40, 10)],
        [],
        [("d", 45, 10)],  # starts before the previous step ended: no idle
    ]
    assert between_steps(steps) == [10, 0]


def test_top_kernels_rank_by_total_time_with_counts_per_step_means_and_shares():
    events = [("many", t, 1.0) for t in range(6)] + [("long", 10, 10.0), ("long", 30, 6.0), ("short", 50, 2.0)]
    assert top_kernels(events, steps=2) == [
        ("long", 1.0, 8.0, 16 / 24),
        ("many", 3.0, 1.0, 6 / 24),
        ("short", 0.5, 2.0, 2 / 24),
    ]
    assert [name for name, *_ in top_kernels(events, steps=2, n=1)] == ["long"]


# One GEMM kernel for qkv and o_proj: it occurs twice a layer, so the layer's first name is no anchor.
LAYER = ["fused_norm", "gemm", "rotary", "attention", "gemm", "fused_norm", "gate_up", "act", "down"]


def _step(num_layers: int) -> list[str]:
    """A step's names: a prologue holding a name twice side by side, layer 0 with a plain input norm, the layers,
    then the final fused norm and the head."""
    layers = ["norm", *LAYER[1:]] + LAYER * (num_layers - 1)
    return ["copy", "embed", "index", "index"] + layers + ["fused_norm", "lm_head", "argmax"]


def test_a_layer_is_the_run_that_repeats_once_per_layer_from_where_the_repeat_starts():
    names = _step(3)
    # Layer 0's norm differs, so each run starts at the qkv GEMM (before the rotary anchor) and ends with the next
    # layer's fused norm.
    assert layer_slice(names, 3, 0) == (5, LAYER[1:] + ["fused_norm"])
    assert layer_slice(names, 3, 1) == (14, LAYER[1:] + ["fused_norm"])
    # The prologue's "index" pair occurs as often as the layers (2) at one spacing, but repeats over less.
    assert layer_slice(_step(2), 2, 1) == (14, LAYER[1:] + ["fused_norm"])


def test_no_layer_without_a_repeat():
    assert layer_slice(_step(3), 1, 0) is None
    assert layer_slice(["a", "b", "c", "a", "d", "e"], 2, 0) is None  # "a" twice, but nothing else repeats
    assert layer_slice(["a", "b", "c"], 2, 0) is None


def test_step_profile_takes_the_figures_per_step():
    marks = [(0, 100), (100, 200)]
    events = [("k", 110, 30), ("k", 10, 20), ("k", 150, 40), ("k", 40, 20)]
    found = step_profile(marks, events, num_layers=1)
    assert found.counts == [2, 2]
    assert (found.step_us, found.busy_us, found.gaps_us, found.between_us) == (100, 55, 10, 50)
    assert found.idle_us == 45
    assert found.top == [("k", 2.0, 27.5, 1.0)]


def test_a_cpu_run_reports_the_same_top_level_ops_every_step(tiny_model_dir, tmp_path, capsys):
    profile.bench_profile(
        (1, 2),
        context=16,
        steps=3,
        trace=str(tmp_path / "trace.json"),
        model=tiny_model_dir("llama"),
        device="cpu",
        kv_cache_bytes=8 << 20,
    )
    out = capsys.readouterr().out
    # A single count per step: each decode step called the same ops.
    counts = re.findall(r"batch (\d+) at ~\d+ tokens: .* ms profiled; (\d+) ops per step\n", out)
    assert [batch for batch, _ in counts] == ["1", "2"] and all(int(n) > 0 for _, n in counts)
    assert re.search(r"^ +aten::\S+ +\d", out, re.M)  # a top op's row
    layers = re.findall(r"layer 1's (\d+) ops, in order", out)  # the second of 2
    assert len(layers) == 2 and all(int(n) > 0 for n in layers)
    for batch in (1, 2):
        trace = json.loads((tmp_path / f"trace-batch{batch}.json").read_text())
        assert any(e.get("name") == profile.STEP for e in trace["traceEvents"])


def test_the_command_line_hands_its_flags_to_the_benchmark(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "profile", "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    assert all(flag in usage for flag in ("--batch", "--steps", "--trace", "--attention-backend"))
    got = {}
    monkeypatch.setattr(profile, "bench_profile", lambda *args, **kwargs: got.update(args=args, kwargs=kwargs))
    cli.main(["bench", "profile", "--batch", "1", "8", "--steps", "4", "--device", "cpu", "--enforce-eager"])
    assert got["args"] == ((1, 8), 512, 4, None)
    assert got["kwargs"] == {"model": None, "device": "cpu", "enforce_eager": True}  # None: the default model
