"""`raylm bench serve`'s rows as printed: a row from `vllm bench serve`'s saved result says nothing of SSE chunks,
which that client does not count, rather than printing nan."""

from bench.serve import print_row
from bench.vllm_client import row_from_result

VLLM_RESULT = {
    "duration": 40.0,
    "completed": 64,
    "num_prompts": 64,
    "output_throughput": 102.4,
    "total_token_throughput": 307.1,
    **{f"{stat}_{key}_ms": 1.0 for stat in ("mean", "median", "p99") for key in ("ttft", "tpot", "itl", "e2el")},
}


def test_a_vllm_client_row_prints_its_figures_and_no_chunk_count(capsys):
    print_row(row_from_result("vllm serve", VLLM_RESULT))
    out = capsys.readouterr().out
    assert "vllm serve: 64/64 ok in 40.0 s, 102.4 output tok/s, 307.1 total tok/s; load average" in out
    assert "nan" not in out and "SSE" not in out


def test_a_raylm_client_row_prints_its_chunk_count(capsys):
    row = row_from_result("raylm serve", VLLM_RESULT) | {"chunks_per_s": 150.0, "tokens_per_chunk": 1.25}
    print_row(row)
    assert "307.1 total tok/s, 150 SSE chunks/s (1.25 tokens per chunk); load" in capsys.readouterr().out
