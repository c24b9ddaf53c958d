"""`raylm bench moe` on tiny shapes: one row per size, the two variants agreeing, and the tp=2 all-reduce timed."""

from cli import main


def test_bench_moe_prints_a_row_per_size(capsys):
    main(
        [
            "bench",
            "moe",
            "--num-experts",
            "4",
            "--top-k",
            "2",
            "--hidden-size",
            "16",
            "--moe-intermediate-size",
            "8",
            "--sizes",
            "1",
            "5",
            "--repeats",
            "1",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("raylm bench moe: top-2 of 4 experts, hidden 16, 8 units")
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "5"]
    assert all(float(r[7]) < 1e-5 for r in rows)  # max |fused - loop|
    assert [r[8:10] for r in rows] == [["0", "KiB"], ["0", "KiB"]]  # 16 and 80 floats: under 1 KiB
    assert all(0 < float(r[10]) < 1000 for r in rows)  # ms of a gloo all-reduce between two processes


def test_random_moe_checkpoint_is_written_once_and_served(default_model_dir):
    """`bench moe --end-to-end`'s model: the shapes asked for, written once, loaded and run by raylm."""
    import json
    from pathlib import Path

    from bench.moe import random_moe_checkpoint
    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    path = random_moe_checkpoint(default_model_dir, 1, 4, 2, 64, 32)
    written = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert random_moe_checkpoint(default_model_dir, 1, 4, 2, 64, 32) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == written
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    experts = config.get("num_experts", config.get("num_local_experts"))  # the key transformers 5 writes
    assert (experts, config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 32)
    llm = LLM(model=path, executor="inprocess", device="cpu", max_model_len=64)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 5
