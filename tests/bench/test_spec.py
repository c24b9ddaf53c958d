"""`raylm bench spec` on a tiny model in process: a row per workload, concurrency and proposer, against none."""

import re

import pytest

from bench import spec
from bench.spec import StepCosts, expected_tokens
from cli import main

PROSE = " ".join(["The copy workload hands the model this paragraph and asks for it back, word for word."] * 5)


def test_bench_spec_prints_a_row_per_workload_concurrency_and_proposer(servable_tiny_model, capsys, tmp_path):
    """Given a draft model (here the model itself), n-gram and the draft are each compared with no speculation;
    the copy workload repeats --copy-source's prose paragraphs (a heading and a table are not prose)."""
    model = servable_tiny_model()
    (tmp_path / "notes.md").write_text(f"# Notes\n\n{PROSE}\n\n| a | table |\n")
    spec = f'{{"method": "draft_model", "model": "{model}", "num_speculative_tokens": 2}}'
    main(
        ["bench", "spec", "--model", model, "--executor", "inprocess", "--device", "cpu", "--speculative-config", spec]
        + ["--concurrency", "1", "--max-tokens", "6", "--kv-cache-bytes", str(64 << 20), "--copy-source", str(tmp_path)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("spec: {'method': 'ngram', 'num_speculative_tokens': 4")
    assert f"; 1 copy prompts ({tmp_path}/*.md paragraphs)" in lines[0]
    rows = [line.split() for line in lines[1:]]
    cells = [("copy", "1:"), ("chat", "1:")]
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
        ("raylm", *c, m) for c in cells for m in ("ngram", "draft_model")
    ]
    assert all(r[-1] == "100.0%" for r in rows if r[4] == "draft_model")  # the model as its own draft


STEP = (
    r"  (plain decode step|verification step, 4 tokens|the target's own draft pass|draft pass|draft catch-up, 4 tokens)"
)
SPEEDUP = (
    r"  a = (0\.6|0\.8): E = ([\d.]+), speedup = [\d.]+ / \(([\d.]+) \+ 3 \* ([\d.]+)\) = ([\d.]+)x; with .*: ([\d.]+)x"
)


def test_step_costs_print_each_steps_time_and_the_speedups_they_give(servable_tiny_model, capsys):
    """At tiny scale on CPU, a Llama target and a one-layer Qwen2 draft (the GPU check's families): the target
    drafting for itself has every proposal accepted, and each step's time, its ratio to the plain step and the
    speedups at acceptance 0.6 and 0.8 are printed, positive, the speedups by the formula printed beside them
    (timings are figures, never asserted on)."""
    target = servable_tiny_model()
    # The Llama's BOS and EOS (LlamaConfig's defaults; Qwen2Config has none): a draft must share them.
    draft = servable_tiny_model("qwen2", num_hidden_layers=1, bos_token_id=1, eos_token_id=2)
    flags = f"--model {target} --draft-model {draft} --device cpu --kv-cache-bytes {16 << 20} --num-threads 1"
    main(["bench", "spec", "--step-costs", *flags.split(), "--context", "16", "--steps", "5"])
    out = capsys.readouterr().out
    assert re.search(r"  acceptance, the target as its own draft: +1\.000 \(greedy: must be 1\)", out), out
    steps = dict(re.findall(STEP + r": +([\d.]+) ms", out))
    assert len(steps) == 5 and all(float(ms) > 0 for ms in steps.values()), out
    speedups = re.findall(SPEEDUP, out)
    assert [(a, e) for a, e, *_ in speedups] == [("0.6", "2.176"), ("0.8", "2.952")], out
    for _, e, verify, draft_ratio, speedup, with_catch_up in speedups:
        assert 0 < float(with_catch_up) < float(speedup)
        assert float(speedup) == pytest.approx(float(e) / (float(verify) + 3 * float(draft_ratio)), rel=0.01)


def test_the_speedup_is_the_expected_tokens_over_the_steps_cost_in_plain_steps():
    costs = StepCosts(k=3, plain=0.010, verify=0.012, self_pass=0.011, acceptance=1.0, draft_pass=0.002, catch_up=0.003)
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3)
    assert costs.speedup(0.8) == pytest.approx(2.952 / (1.2 + 3 * 0.2))
    assert costs.speedup(0.8, with_catch_up=True) == pytest.approx(2.952 / (1.2 + 3 * 0.2 + 0.3))


def test_step_costs_fail_after_printing_when_the_target_rejects_its_own_proposals(monkeypatch, capsys):
    costs = StepCosts(k=3, plain=0.010, verify=0.012, self_pass=0.011, acceptance=0.9)
    monkeypatch.setattr(spec, "measure_step_costs", lambda *args, **kwargs: (costs, ["target t: what"]))
    with pytest.raises(RuntimeError, match="0.9000 of its proposals accepted"):
        spec.bench_step_costs("t", None, 3, 16, 5)
    assert "  a = 0.8: E = 2.952" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--draft-model", "d"], "--draft-model is --step-costs'"),
        (["--step-costs", "--speculative-config", '{"method": "ngram"}'], "sets its own speculative configs"),
    ],
)
def test_the_draft_flags_belong_to_one_mode_each(flags, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spec", "--device", "cpu", *flags])
    assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_a_copy_source_without_prose_is_refused_before_any_engine_starts(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# Only a heading\n\n| and | a table |\n")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spec", "--device", "cpu", "--copy-source", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--copy-source {tmp_path}: no Markdown prose paragraphs there" in capsys.readouterr().err
