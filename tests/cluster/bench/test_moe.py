"""`raylm bench moe` on tiny shapes: one row per size, the two variants agreeing, and the tp=2 all-reduce timed."""

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
    assert [r[8:10] for r in rows] == [["0", "KiB"], ["0", "KiB"]]  # 16 and 80 floats: under 1 KiB
    assert all(0 < float(r[10]) < 1000 for r in rows)  # ms of a gloo all-reduce between two processes
