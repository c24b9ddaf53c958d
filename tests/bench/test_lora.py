"""`raylm bench lora` on a tiny model: a row per variant, every request's tokens counted."""

from cli import main


def test_bench_lora_prints_a_row_per_variant(capsys, servable_tiny_model):
    model = servable_tiny_model()
    args = ["--num-requests", "4", "--prompt-len", "8", "--max-tokens", "3", "--mixes", "1", "2", "--rank", "4"]
    main(["bench", "lora", "--model", model, "--executor", "inprocess", "--device", "cpu", *args])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("raylm bench lora:"))
    rows = [line.rsplit(None, 3)[0] for line in lines[start + 2 :]]
    assert rows == [
        "base model",
        "1 adapters, one batch",
        "1 adapters, looped",
        "2 adapters, one batch",
        "2 adapters, looped",
    ]
