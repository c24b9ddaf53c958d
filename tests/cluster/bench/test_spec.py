"""`raylm bench spec` on a tiny model in process: a row per workload, concurrency and proposer, against none."""

from cluster.cli import main


def test_bench_spec_prints_a_row_per_workload_concurrency_and_proposer(servable_tiny_model, capsys):
    """Given a draft model (here the model itself), n-gram and the draft are each compared with no speculation."""
    model = servable_tiny_model()
    spec = f'{{"method": "draft_model", "model": "{model}", "num_speculative_tokens": 2}}'
    main(
        ["bench", "spec", "--model", model, "--executor", "inprocess", "--device", "cpu", "--speculative-config", spec]
        + ["--concurrency", "1", "--max-tokens", "6", "--kv-cache-bytes", str(64 << 20)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("spec: {'method': 'ngram', 'num_speculative_tokens': 4")
    rows = [line.split() for line in lines[1:]]
    cells = [("copy", "1:"), ("chat", "1:")]
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
        ("raylm", *c, m) for c in cells for m in ("ngram", "draft_model")
    ]
    assert all(r[-1] == "100.0%" for r in rows if r[4] == "draft_model")  # the model as its own draft
