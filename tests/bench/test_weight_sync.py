"""`raylm bench weight-sync` on a tiny model at tp=2 on the session's Ray: the push through the weight-update group,
the memcpy floor, sleep and wake, and the engine greedy-identical after all of it."""

from cli import main


def test_bench_weight_sync_prints_a_row_per_engine_and_the_same_output_after(servable_tiny_model, ray_session, capsys):
    model = servable_tiny_model()
    main(f"bench weight-sync --model {model} --tp 2 --bucket-mb 1 --num-threads 1 --repeats 2".split())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("raylm bench weight-sync: buckets of 1 MB")
    (row,) = [line.split() for line in lines[2:]]
    tp, _, first_push_s, push_s, floor_s, ratio, *sleep_wake, start_s, start_per_push, same = row
    assert tp == "2" and same == "True"
    assert float(first_push_s) > 0 and float(push_s) > 0 and float(floor_s) > 0
    assert float(ratio) > 1  # a push moves the bytes a memcpy does, and more
    assert len(sleep_wake) == 4 and float(start_s) > 0
