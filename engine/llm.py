"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from engine.config import EngineConfig
from engine.controls import OFFLINE, forwarding
from engine.interface import Engine
from engine.model_files import (
    generation_defaults,
    load_tokenizer,
    not_an_embedding_model,
    pooling_type,
    serves_embeddings,
)
from engine.output import SampleOutput
from scheduler import EngineRequest, RequestError, RequestOutput, SampledLogprobs, SamplingParams
from workers.grammars import closed_schema

if TYPE_CHECKING:
    from engine.client import EngineClient


@dataclass(slots=True)
class Completion:
    """One sample of one prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledLogprobs] | None = None
    error: str | None = None


@dataclass(slots=True)
class GenerateOutput:
    """Everything generated for one prompt: ``n`` completions, in index order. With ``prompt_logprobs``
    asked, ``prompt_logprobs[p]`` is prompt token p's given the tokens before it (None for p = 0, as vLLM)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[SampledLogprobs | None] | None = None
    embedding: list[float] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``): its final hidden states pooled as ``pooling_type`` says,
    shortened to ``dimensions`` if asked, L2-normalised."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]


@forwarding(
    lambda llm, name, args, kwargs: llm.engine.sync(getattr(llm.engine, name)(*args, **kwargs)), OFFLINE, sync=True
)
class LLM:
    """Runs a whole list of prompts to completion with continuous batching.

    Prompts may be strings (tokenized here, chat template optional) or lists
    of token ids. The engine checks each request as it is submitted: a bad one
    raises ValueError naming it (its index, the field, the value and the rule)
    instead of failing its batch mid-way; a call that fails or is interrupted
    part-way aborts the requests it submitted, so none of them runs on.

    ``executor="ray"`` (the default) runs the Ray engine: a scheduler actor
    and ``tensor_parallel_size`` worker actors, on the cluster at ``address``
    or a local Ray. ``executor="inprocess"`` runs the scheduler and one worker
    in this process, for tp=1 debugging.

    For RL rollouts (issue #71) it sleeps and wakes, and takes new weights, as
    vLLM's and SGLang's offline engines name it: each call is the engine's
    async control (client.EngineClient) run to completion (Engine.sync).
    ``generate`` while asleep is a RuntimeError, since nothing would wake it.
    """

    def __init__(
        self, model: str | None = None, *, executor: str = "ray", address: str | None = None, **engine_kwargs
    ) -> None:
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine: Engine | EngineClient  # both executors are both: stepped here, and the async controls
        if executor == "ray":
            from engine.ray_client import RayEngine

            self.engine = RayEngine(self.config, address)
        elif executor == "inprocess":
            if address is not None:
                raise ValueError(f"executor='inprocess' joins no cluster, address={address!r}")
            from engine.inprocess import InProcessEngine

            self.engine = InProcessEngine(self.config)
        else:
            raise ValueError(f"executor={executor!r}: choose 'ray' or 'inprocess'")
        self.tokenizer = load_tokenizer(self.config, self.engine.model_path)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the engine (for Ray: its actors and placement group) without waiting for garbage collection."""
        self.engine.shutdown()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no params: SamplingParams' defaults, with the model's own where
        --generation-config (auto: its generation_config.json) names them, as vLLM's LLM does."""
        return SamplingParams(**generation_defaults(self.config, self.engine.model_path))

    def _closed(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its JSON schema's objects closed, as the server closes them, unless
        structured_outputs_disable_additional_properties is off (workers/grammars.close_objects)."""
        so = params.structured_outputs if isinstance(params, SamplingParams) else None
        if so is None or so.json is None or not self.config.structured_outputs_disable_additional_properties:
            return params
        return dataclasses.replace(
            params, structured_outputs=dataclasses.replace(so, json=closed_schema(so.json, True))
        )

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[GenerateOutput]:
        """Generate for every prompt; ``lora_name`` names the LoRA adapter of all prompts, or of each (None: the
        base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        check_per_prompt(len(prompts), params_list, priority, loras)
        requests = [
            EngineRequest(
                request_id=str(next(self._ids)),
                prompt_token_ids=self.tokenizer.encode(p) if isinstance(p, str) else list(p),
                sampling_params=self._closed(params_list[i]),
                priority=priority[i] if priority else 0,
                lora_name=loras[i],
            )
            for i, p in enumerate(prompts)
        ]
        if self.is_sleeping():
            raise RuntimeError("the engine is asleep: call LLM.wake_up() before generate")
        total = sum(p.n for p in params_list if isinstance(p, SamplingParams))  # the engine refuses others
        with tqdm(total=total, desc="generate", disable=not use_tqdm, unit="seq") as bar:
            outputs = Outputs(self.tokenizer, requests, prompts, bar)
            self._run(requests, outputs)
        return outputs.results

    def _run(self, requests: list[EngineRequest], outputs: Outputs) -> None:
        """Submit every request and step the engine until all have finished, aborting each one whose samples all
        ended at a stop string; a call that fails or is interrupted part-way aborts every request it submitted."""
        engine, submitted = self.engine, 0
        try:
            for i, request in enumerate(requests):
                submitted += 1  # before the call: aborting a request the engine never took is a no-op
                try:
                    outputs.absorb(engine.add_request(request))
                except RequestError as e:
                    where = f"request {i} (prompts[{i}], params[{i}])"
                    raise RequestError(e.field, e.value, e.rule, f"{where}: {e}") from None
            while engine.has_unfinished_requests():
                for request_id in outputs.absorb(engine.step()):
                    engine.abort(request_id)
        except BaseException:  # KeyboardInterrupt too: no request of this call may run on
            for request in requests[:submitted]:
                engine.abort(request.request_id)
            raise

    # ---- RL rollouts: sleep, weight updates (the semantics are client.EngineClient's; the class decorator
    # forwards engine/controls.py's OFFLINE controls to the engine) ----

    @property
    def weight_version(self) -> str:
        """ "default" until an update names a version."""
        return self.engine.sync(self.engine.get_weight_version())

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every rank's reply to Worker method ``method``."""
        return self.engine.sync(self.engine.collective_rpc(method, args))

    def get_weights_by_name(self, name: str) -> list:
        """Every rank's CPU copy of its shard of parameter ``name`` (raylm's name: model.named_parameters)."""
        return self.engine.sync(self.engine.get_weights_by_name(name))

    def embed(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        *,
        dimensions: int | None = None,
        use_tqdm: bool = True,
        lora_name: str | list[str | None] | None = None,
    ) -> list[EmbeddingOutput]:
        """Every prompt's embedding, batched with continuous batching as ``generate`` runs prompts; served for an
        embedding model or with ``runner="pooling"``, as /v1/embeddings is (ValueError otherwise)."""
        model_path = self.engine.model_path
        if not serves_embeddings(self.config.runner, model_path):
            raise ValueError(not_an_embedding_model(self.config.model or model_path))
        params = SamplingParams(
            max_tokens=1, pooling=pooling_type(self.config.pooling_type, model_path), dimensions=dimensions
        )
        results = self.generate(prompts, params, use_tqdm=use_tqdm, lora_name=lora_name)
        failed = next((r for r in results if r.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} got no embedding: {failed.outputs[0].error}")
        return [EmbeddingOutput(r.request_id, r.prompt, r.prompt_token_ids, r.embedding) for r in results]


def check_per_prompt(
    num_prompts: int, params: list[SamplingParams], priority: list[int] | None, loras: list[str | None]
) -> None:
    """``generate``'s per-prompt lists: one entry per prompt, and int priorities."""
    for what, entries in (("SamplingParams", params), ("priorities", priority), ("lora_name entries", loras)):
        if entries is not None and len(entries) != num_prompts:
            raise ValueError(f"got {len(entries)} {what} for {num_prompts} prompts")
    for i, p in enumerate(priority or ()):
        if not isinstance(p, int) or isinstance(p, bool):
            raise ValueError(f"priority[{i}]={p!r} is not an int")


class Outputs:
    """What one ``generate`` call has gathered from the engine's deltas, as ``results`` (one GenerateOutput per
    request, in order).

    Each sample's text is built as its deltas arrive by the output path the server streams with (SampleOutput:
    incremental detokenization, stop strings), so both give the same text and finish reason. Invariants: a
    sample's deltas after it finished (a stop string matched while the engine still ran it) are dropped, as
    the server drops them; deltas of requests not of this call (an earlier call's, aborted when it failed) are
    ignored; ``bar`` advances once per sample that finished.
    """

    def __init__(self, tokenizer, requests: list[EngineRequest], prompts: list, bar: tqdm) -> None:
        self.tokenizer, self.bar = tokenizer, bar
        self.requests = {r.request_id: r for r in requests}
        self.results = [
            GenerateOutput(r.request_id, p if isinstance(p, str) else None, r.prompt_token_ids)
            for r, p in zip(requests, prompts)
        ]
        self.by_id = {r.request_id: r for r in self.results}
        self.samples: dict[tuple[str, int], tuple[SampleOutput, Completion]] = {}
        self.engine_finished: set[tuple[str, int]] = set()

    def absorb(self, deltas: list[RequestOutput]) -> list[str]:
        """Take the engine's deltas; return the requests whose samples have all finished here while the engine
        still runs one of them (stopped by a stop string: the caller aborts them there)."""
        stopped = []
        for o in deltas:
            if o.request_id not in self.by_id:
                continue
            if o.finished:
                self.engine_finished.add((o.request_id, o.index))
            if self._absorb(o) and self._stopped_here(o.request_id):
                stopped.append(o.request_id)
        return stopped

    def _absorb(self, o: RequestOutput) -> bool:
        """Fold one delta into its sample; whether it finished the sample."""
        r = self.by_id[o.request_id]
        sample, c = self._sample(r, o.index)
        if sample.finish_reason is not None:
            return False
        if o.prompt_logprobs is not None and r.prompt_logprobs is None:  # n > 1: every sample brings the same
            r.prompt_logprobs = [None, *o.prompt_logprobs]
        if o.new_logprobs:
            c.logprobs = (c.logprobs or []) + o.new_logprobs
        if o.embedding is not None:
            r.embedding = o.embedding
        c.text += sample.add(o.new_token_ids, o.finish_reason if o.finished else None)
        c.finish_reason = sample.finish_reason
        if o.finished:
            c.error, r.num_cached_tokens = o.error, o.num_cached_tokens
        if sample.finish_reason is not None:
            self.bar.update(1)
        return sample.finish_reason is not None

    def _sample(self, r: GenerateOutput, index: int) -> tuple[SampleOutput, Completion]:
        """Sample ``index`` of ``r``: its output path and its Completion (made on its first delta)."""
        key = (r.request_id, index)
        if key not in self.samples:
            sample = SampleOutput(self.tokenizer, r.prompt_token_ids, self.requests[r.request_id].sampling_params)
            self.samples[key] = sample, Completion(index, "", sample.token_ids, None)
            r.outputs = sorted([*r.outputs, self.samples[key][1]], key=lambda c: c.index)
        return self.samples[key]

    def _stopped_here(self, request_id: str) -> bool:
        keys = [(request_id, i) for i in range(self.requests[request_id].sampling_params.n)]
        finished = all(k in self.samples and self.samples[k][0].finish_reason is not None for k in keys)
        return finished and not all(k in self.engine_finished for k in keys)
