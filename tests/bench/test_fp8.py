"""`raylm bench fp8` on a tiny model on CPU: every variant runs, says what it holds, and is compared with the
baseline; the FP8 cache holds as many more blocks as its pages are smaller (timings are figures, never asserted)."""

import re

from cli import main


def test_bench_fp8_runs_each_variant_and_prints_its_ratios(servable_tiny_model, capsys):
    model = servable_tiny_model()
    flags = f"--model {model} --device cpu --num-threads 1 --kv-cache-bytes {4 << 20} --num-requests 4"
    flags += " --min-len 4 --max-len 8 --context 16 --long-batch 4 --long-context 48 --steps 2"
    main(["bench", "fp8", *flags.split()])
    out = capsys.readouterr().out
    heads = re.findall(
        r"^(baseline|fp8 weights|fp8 KV): .*, (\d+) of \d+ weight tensors float8, KV pages ([^,]+), (\d+) KV blocks",
        out,
        re.M,
    )
    assert [(h[0], h[2]) for h in heads] == [
        ("baseline", "torch.float32"),
        ("fp8 weights", "torch.float32"),
        ("fp8 KV", "torch.float8_e4m3fn"),
    ], out
    # On CPU the FP8 weights are dequantized at load: no float8 tensor is left in the model.
    assert [h[1] for h in heads] == ["0", "0", "0"]
    base_blocks, kv_blocks = int(heads[0][3]), int(heads[2][3])
    assert kv_blocks >= 3.9 * base_blocks  # 1-byte pages in place of 4-byte ones, in the same bytes
    assert len(re.findall(r"^ +4 requests at ~48 tokens: +[\d.]+ ms per step", out, re.M)) == 2  # baseline, KV
    ratios = dict(
        re.findall(
            r"^  (fp8 weights|fp8 KV) / baseline: output tok/s [\d.]+x; decode step by requests 1: [\d.]+x(.*)$",
            out,
            re.M,
        )
    )
    assert set(ratios) == {"fp8 weights", "fp8 KV"}, out
    assert re.search(r"KV blocks 1\.00x$", ratios["fp8 weights"]) and "long-context decode step" in ratios["fp8 KV"]
