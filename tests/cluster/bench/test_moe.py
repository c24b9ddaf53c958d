"""`raylm bench moe` on tiny shapes: one row per size, and the two variants agreeing."""

from cluster.cli import main


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
