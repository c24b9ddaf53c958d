"""`raylm bench embed` on a tiny model: both rows, and the two sets of vectors agreeing."""

from cli import main


def test_bench_embed_prints_both_rows_and_agrees_with_transformers(capsys, tiny_model_dir):
    path = tiny_model_dir("llama")
    main(["bench", "embed", "--model", path, "--num-inputs", "6", "--input-len", "20", "--batch", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("raylm bench embed: 6 inputs x 20 tokens")
    assert [line.split()[0] for line in lines[2:4]] == ["raylm", "transformers"]
    assert float(lines[4].rsplit(" ", 1)[1]) < 1e-4  # max |difference|
