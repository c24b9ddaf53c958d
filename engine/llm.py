"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.config import EngineConfig
from engine.interface import Engine
from engine.model_files import (
    generation_defaults,
    load_tokenizer,
    not_an_embedding_model,
    pooling_type,
    serves_embeddings,
)
from scheduler import EngineRequest, RequestError, SampledLogprobs, SamplingParams
from workers.grammars import closed_schema


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
    """

    def __init__(
        self, model: str | None = None, *, executor: str = "ray", address: str | None = None, **engine_kwargs
    ) -> None:
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine: Engine
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
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_name entries for {len(prompts)} prompts")
        for i, p in enumerate(priority or ()):
            if not isinstance(p, int) or isinstance(p, bool):
                raise ValueError(f"priority[{i}]={p!r} is not an int")
        params_list = [self._closed(p) for p in params_list]
        results = [
            GenerateOutput(
                str(next(self._ids)),
                p if isinstance(p, str) else None,
                self.tokenizer.encode(p) if isinstance(p, str) else list(p),
            )
            for p in prompts
        ]
        by_id = {r.request_id: r for r in results}
        total = sum(p.n for p in params_list if isinstance(p, SamplingParams))  # the engine refuses others
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm, unit="seq")
        engine = self.engine
        pending: dict[tuple[str, int], Completion] = {}

        def absorb(outs) -> None:
            for o in outs:
                if o.request_id not in by_id:  # a request of an earlier call's, aborted when that call failed
                    continue
                c = pending.get((o.request_id, o.index))
                if c is None:
                    c = pending[(o.request_id, o.index)] = Completion(o.index, "", [], None, None)
                c.token_ids.extend(o.new_token_ids)
                r = by_id[o.request_id]
                if o.prompt_logprobs is not None and r.prompt_logprobs is None:  # n > 1: every sample brings the same
                    r.prompt_logprobs = [None, *o.prompt_logprobs]
                if o.new_logprobs:
                    c.logprobs = (c.logprobs or []) + o.new_logprobs
                if o.embedding is not None:
                    r.embedding = o.embedding
                if o.finished:
                    c.finish_reason, c.error = o.finish_reason, o.error
                    by_id[o.request_id].num_cached_tokens = o.num_cached_tokens
                    bar.update(1)

        submitted = 0
        try:
            for i, (r, p) in enumerate(zip(results, params_list)):
                submitted += 1  # before the call: aborting a request the engine never took is a no-op
                try:
                    finals = engine.add_request(
                        EngineRequest(
                            request_id=r.request_id,
                            prompt_token_ids=r.prompt_token_ids,
                            sampling_params=p,
                            priority=priority[i] if priority else 0,
                            lora_name=loras[i],
                        )
                    )
                except RequestError as e:
                    where = f"request {i} (prompts[{i}], params[{i}])"
                    raise RequestError(e.field, e.value, e.rule, f"{where}: {e}") from None
                absorb(finals)
            while engine.has_unfinished_requests():
                absorb(engine.step())
        except BaseException:  # KeyboardInterrupt too: no request of this call may run on
            for r in results[:submitted]:
                engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        for r in results:
            r.outputs = sorted((c for (rid, _), c in pending.items() if rid == r.request_id), key=lambda c: c.index)
            for c in r.outputs:
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return results

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
