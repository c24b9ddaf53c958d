"""`raylm bench spec` on a tiny model in process: a row per workload and concurrency, with and without proposals."""

from cluster.cli import main


def test_bench_spec_prints_a_row_per_workload_and_concurrency(servable_tiny_model, capsys):
    model = servable_tiny_model()
    main(
        ["bench", "spec", "--model", model, "--executor", "inprocess", "--device", "cpu"]
        + ["--concurrency", "1", "2", "--max-tokens", "6", "--kv-cache-bytes", str(64 << 20)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("spec: {'method': 'ngram', 'num_speculative_tokens': 4")
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[2]) for r in rows] == [("copy", "1:"), ("copy", "2:"), ("chat", "1:"), ("chat", "2:")]
