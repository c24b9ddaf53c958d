"""examples/rl_loop.py end to end for one round, on a tiny model at tp=2 on the session's Ray: rollouts, the reward,
the trainer's step, sleep, the broadcast of the weights and wake-up (what it computes is tests/engine/test_rl_ray.py's
to check; this shows the example still runs)."""

import importlib.util
import sys
from pathlib import Path

from ray import cloudpickle

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def test_the_rl_loop_runs_a_round_and_prints_its_reward_and_seconds(
    servable_tiny_model, ray_session, capsys, monkeypatch
):
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rl_loop", example)
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)  # its Trainer actor class travels to Ray's workers by value
    example.main(
        ["--model", servable_tiny_model(), "--tp", "2", "--rounds", "1", "--bucket-mb", "1", "--max-model-len", "256"]
    )
    header, row = capsys.readouterr().out.splitlines()[-2:]
    assert header.split() == [
        "round",
        "reward",
        "generate",
        "s",
        "sleep",
        "s",
        "train",
        "s",
        "wake",
        "s",
        "update",
        "s",
    ]
    round_, reward, *seconds = row.split()
    assert round_ == "1" and 0 <= float(reward) <= 1
    assert len(seconds) == 5 and all(float(s) >= 0 for s in seconds) and float(seconds[0]) > 0
