"""The no-work runner (benchmarking only) keeps the scheduler's contract: it samples exactly when the
scheduler expects a token, through chunked prefill, preemption and resumption, and stays deterministic."""

from scheduler import EngineRequest, SamplingParams, Scheduler
from tests.scheduler.configs import scheduler_config
from workers.no_work import NoWorkRunner

VOCAB = 49152


def run(num_blocks: int, prompts: dict[str, list[int]], max_tokens: int, chunk: int = 0) -> tuple[dict, int]:
    sched = Scheduler(
        scheduler_config(
            num_blocks,
            block_size=4,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=chunk,
            enable_prefix_caching=True,
        ),
        eos_token_id=0,
    )
    runner = NoWorkRunner(VOCAB)
    for rid, prompt in prompts.items():
        sched.add_request(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
        )
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished = {}
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute_model(so)):
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert set(finished.values()) == {"length"}, finished
    return tokens, sched.stats().num_preemptions


def test_every_request_gets_its_tokens_with_chunked_prefill():
    prompts = {f"r{i}": list(range(100 + i, 140 + 3 * i)) for i in range(4)}
    tokens, _ = run(200, prompts, max_tokens=7, chunk=8)
    assert all(len(t) == 7 for t in tokens.values())
    assert all(1000 <= t < VOCAB for ts in tokens.values() for t in ts)


def test_preemption_and_resumption_give_the_same_tokens():
    prompts = {f"r{i}": list(range(200 + i, 230 + i)) for i in range(4)}
    roomy, none = run(200, prompts, max_tokens=20)
    tight, preempted = run(40, prompts, max_tokens=20)  # 4 x 50 tokens need 52 blocks of 4: some are preempted
    assert none == 0 and preempted > 0
    assert tight == roomy


def test_only_rank_0_returns_tokens():
    sched = Scheduler(
        scheduler_config(
            16, block_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False
        ),
        eos_token_id=0,
    )
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=2))
    )
    so = sched.schedule()
    assert NoWorkRunner(VOCAB, is_driver=False).execute_model(so) is None
    out = NoWorkRunner(VOCAB).execute_model(so)
    assert out.req_ids == ["a"] and len(out.sampled_token_ids) == 1
