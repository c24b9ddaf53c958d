"""A model runner that does no tensor work, for measuring the serving path alone (benchmarking only)."""

from __future__ import annotations

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.runner_inputs import PendingStep

# Token ids it cycles through start past the special tokens every Llama-family tokenizer puts first, so
# each one decodes to visible text and the serving path detokenizes, formats and streams it as it would
# a real model's.
FIRST_TOKEN_ID = 1000
CYCLE = 997  # prime: consecutive tokens of a request differ, and so do requests at different lengths


class NoWorkRunner:
    """Returns one token per request whose scheduled tokens complete it, at once, with no forward pass.

    It applies the step's diff exactly as ModelRunner does (the same rule for
    who samples: computed + scheduled == the request's token count), and every
    rank appends each sample itself as ModelRunner's ranks do, so the
    scheduler, the Ray round trip and everything downstream run unchanged,
    async scheduling included; only the model and the KV cache are gone. The
    token is a function of the request's length, so a run is reproducible and
    every rank knows it without a broadcast.
    """

    def __init__(self, vocab_size: int, is_driver: bool = True) -> None:
        self.span = max(1, min(CYCLE, vocab_size - FIRST_TOKEN_ID))
        self.first = min(FIRST_TOKEN_ID, vocab_size - 1)
        self.is_driver = is_driver
        self.num_tokens: dict[str, int] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        num_tokens = self.num_tokens
        for req_id in scheduler_output.finished_req_ids:
            num_tokens.pop(req_id, None)
        new_reqs = scheduler_output.scheduled_new_reqs
        for new in new_reqs:
            num_tokens[new.req_id] = len(new.prompt_token_ids)
        num_computed = {new.req_id: new.num_computed_tokens for new in new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        num_computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids, sampled = [], []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request_tokens = num_tokens[req_id]
            if num_computed[req_id] + num_new == request_tokens:
                req_ids.append(req_id)
                sampled.append(self.first + request_tokens % self.span)
                num_tokens[req_id] = request_tokens + 1
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled) if self.is_driver else None

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """The step, finished at once (the Worker's interface: ModelRunner.launch)."""
        return PendingStep([], finished=True, output=self.execute_model(scheduler_output))

    def finish(self, pending: PendingStep) -> ModelRunnerOutput | None:
        return pending.output
