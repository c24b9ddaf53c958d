"""Batch inference over Ray Data: a dataset's rows through a fixed pool of raylm engines.

``build_processor(config)(ds)`` is a lazy Dataset of three maps: TokenizeStage (chat template or prompt to token
ids, CPU), EngineStage (an actor pool of ``concurrency`` actors, each owning one RayEngine), DetokenizeStage (text,
CPU). A row carries ``messages`` (chat) or ``prompt`` (text or token ids) and may carry ``sampling_params`` (a dict
of SamplingParams' fields, plus ``stop``: strings that end a sample); every input column is kept. A row that cannot
run gets its ``error`` (and ``error_param``, the field it names) and passes the later stages untouched: one bad row
fails no batch. A row also given ``prompt_token_ids`` runs them as they are.

Each row comes out with ``prompt_token_ids``, ``num_input_tokens``, ``generated_text``, ``generated_token_ids`` and
``finish_reason`` (its first sample's), ``num_generated_tokens`` (all samples'), ``num_cached_tokens``, ``choices``
(every sample: index, text, token_ids, finish_reason, logprobs), ``first_token_s`` and ``total_s`` (seconds from
its submission to the engine), ``error`` and ``error_param`` (None when it ran).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, NoReturn

import pyarrow as pa
import ray

from batch.config import BatchConfig
from batch.orphans import engine_group_name, watch
from engine.config import EngineConfig
from engine.model_files import generation_defaults, load_tokenizer
from engine.request_check import CONSTRAINT_KINDS
from scheduler import EngineRequest, RequestError, SamplingParams, StructuredOutputsParams
from workers.grammars import closed_schema

logger = logging.getLogger(__name__)

# What a row's sampling_params may hold: SamplingParams' fields that take plain values, and ``stop`` (strings).
ROW_PARAMS = frozenset(
    {f.name for f in dataclasses.fields(SamplingParams)}
    - {"pooling", "dimensions", "bad_words_token_ids", "prompt_logprobs"}
) | {"stop"}
# The columns the engine stage adds (sample 0's in the generated_* ones; ``choices`` holds all n), so that every
# row of a batch, failed or not, has the same columns.
ENGINE_COLUMNS = (
    "generated_token_ids",
    "finish_reason",
    "num_generated_tokens",
    "num_cached_tokens",
    "choices",
    "first_token_s",
    "total_s",
)


def build_processor(
    config: BatchConfig,
    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Callable[[ray.data.Dataset], ray.data.Dataset]:
    """The processor: ``processor(ds)`` is ``ds`` through ``preprocess`` (a row map), the three stages and
    ``postprocess``, lazily; nothing runs until the Dataset is consumed."""

    def cpu_stage(ds: ray.data.Dataset, stage: type) -> ray.data.Dataset:
        return ds.map_batches(
            stage,
            fn_constructor_kwargs={"engine_config": config.engine},
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=config.tokenize_concurrency),
            num_cpus=1,
        )

    def processor(ds: ray.data.Dataset) -> ray.data.Dataset:
        watch()
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = cpu_stage(ds, TokenizeStage)
        ds = ds.map_batches(
            EngineStage,
            fn_constructor_kwargs={"engine_config": config.engine},
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(
                size=config.concurrency, max_tasks_in_flight_per_actor=config.batches_in_flight
            ),
            max_concurrency=config.batches_in_flight,
            # Ray Data's defaults, named here because EngineStage._engine_failed depends on them: an actor that
            # dies is started again, and the batches it had are run again.
            max_restarts=-1,
            max_task_retries=-1,
            num_cpus=0,  # the engine reserves its ranks' and scheduler's resources in its own placement group
        )
        ds = cpu_stage(ds, DetokenizeStage)
        return ds.map(postprocess) if postprocess is not None else ds

    return processor


def _rows(batch: pa.Table) -> list[dict[str, Any]]:
    return batch.to_pylist()


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows)


def _given(row: dict[str, Any]) -> dict[str, Any]:
    """The row's sampling params as given: Arrow fills a key another row of the block has with None."""
    return {k: v for k, v in (row.get("sampling_params") or {}).items() if v is not None}


def _stops(given: dict[str, Any]) -> list[str]:
    stop = given.get("stop") or []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


class TokenizeStage:
    """Each row's prompt as token ids (``prompt_token_ids``): its messages through the chat template (with the
    generation prompt), its text encoded, or its ids as given; a row the template refuses gets its error."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.tokenizer = load_tokenizer(engine_config, engine_config.resolved_model())

    def __call__(self, batch: pa.Table) -> pa.Table:
        return _table([self._row(r) for r in _rows(batch)])

    def _row(self, row: dict[str, Any]) -> dict[str, Any]:
        row = {"error": None, "error_param": None, "prompt_token_ids": None, **row, "num_input_tokens": None}
        if row["error"] is not None:
            return row
        try:
            ids = list(self._prompt_ids(row))
        except RequestError as e:
            return row | {"error": str(e), "error_param": e.field}
        except Exception as e:  # templates raise on what they cannot render (roles out of order, ...)
            return row | {"error": f"messages: the chat template failed: {e}", "error_param": "messages"}
        return row | {"prompt_token_ids": ids, "num_input_tokens": len(ids)}

    def _prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """The row's ids as given, else its messages rendered, else its prompt's text encoded or its ids."""
        messages, prompt = row.get("messages"), row.get("prompt")
        if row["prompt_token_ids"] is not None:
            return row["prompt_token_ids"]
        if messages is not None:
            messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt is not None:
            return prompt
        rule = "a row needs messages, a prompt or prompt_token_ids"
        raise RequestError("prompt", None, rule, rule)


@dataclasses.dataclass(slots=True)
class _Sample:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    error: str | None = None  # the engine's reason, for an "error" finish


class EngineStage:
    """One RayEngine, its ranks in a placement group of their own (so TP x PP engines are gang-placed), named
    after this actor so that the group goes when the actor does (batch.orphans); the rows of every batch in
    flight run concurrently through its async ``generate``, at most max_num_seqs at once.

    RayEngine rather than the in-process engine: it runs every setting the server takes (tensor and pipeline
    parallelism included), and its async streams keep many requests in flight from this actor's event loop
    without a step loop of our own. A row's stop strings are matched here on its decoded tokens, so that the
    sample ends (and its request is aborted in the engine) at the stop, not at max_tokens.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        from engine.ray_client import RayEngine

        self.engine = RayEngine(engine_config, placement_group_name=engine_group_name())
        self.tokenizer = load_tokenizer(engine_config, self.engine.model_path)
        self.defaults = generation_defaults(engine_config, self.engine.model_path)
        # The longest sequence one request may reach: the context, or the whole KV cache (less the null block).
        self.max_seq_len = min(self.engine.max_model_len, (self.engine.num_blocks - 1) * engine_config.block_size)
        self.max_num_seqs = engine_config.max_num_seqs
        self.close_objects = engine_config.structured_outputs_disable_additional_properties
        self.slots: asyncio.Semaphore | None = None

    async def __call__(self, batch: pa.Table) -> pa.Table:
        if self.slots is None:  # made on the actor's event loop, which runs every batch
            self.slots = asyncio.Semaphore(self.max_num_seqs)
        return _table(await asyncio.gather(*(self._row(r) for r in _rows(batch))))

    async def _row(self, row: dict[str, Any]) -> dict[str, Any]:
        row = row | dict.fromkeys(ENGINE_COLUMNS)
        if row["error"] is not None:
            return row
        start = time.monotonic()
        given = _given(row)
        try:
            params = self._params(row["prompt_token_ids"], given)
            async with self.slots:
                samples, first_token_s, num_cached = await self._generate(row["prompt_token_ids"], params, given)
        except RequestError as e:
            return row | {"error": str(e), "error_param": e.field}
        except Exception:
            why = await asyncio.to_thread(self._why_unhealthy)
            if why is None:
                raise  # not the engine's failure: a bug, which must end the job, not run it again and again
            self._engine_failed(why)
        failed = next((s for s in samples if s.finish_reason == "error"), None)
        if failed is not None:
            why = await asyncio.to_thread(self._why_unhealthy)
            if why is not None:
                self._engine_failed(why)
            return row | {"error": f"the request failed in the engine: {failed.error}", "error_param": None}
        return row | {
            "generated_token_ids": samples[0].token_ids,
            "finish_reason": samples[0].finish_reason,
            "num_generated_tokens": sum(len(s.token_ids) for s in samples),
            "num_cached_tokens": num_cached,
            "choices": [
                {"index": i, "token_ids": s.token_ids, "finish_reason": s.finish_reason, "logprobs": s.logprobs}
                for i, s in enumerate(samples)
            ],
            "first_token_s": first_token_s,
            "total_s": time.monotonic() - start,
        }

    def _why_unhealthy(self) -> str | None:
        try:
            self.engine.check_health()
        except Exception as e:  # RuntimeError naming the lost ranks, or the scheduler actor's death
            return f"{type(e).__name__}: {e}"
        return None

    def _engine_failed(self, why: str | None) -> NoReturn:
        """A failed engine (a rank died, a step raised) serves no row again, and an exception out of a batch would
        end the whole job. So this actor exits as a crash does: Ray Data starts it again (its actors restart
        without limit) with a new engine and runs its unfinished batches there (as do its tasks); none of their
        rows has been answered, since a batch is answered whole."""
        logger.error("the engine failed (%s): its actor exits, to be started again with its batches", why)
        logging.shutdown()
        os._exit(1)

    def _params(self, prompt_token_ids: list[int], given: dict[str, Any]) -> SamplingParams:
        """The row's SamplingParams: its own fields, the model's defaults for those it leaves unset, and by default
        all the room its prompt leaves; RequestError naming the field otherwise."""
        unknown = sorted(set(given) - ROW_PARAMS)
        if unknown:
            raise RequestError(
                f"sampling_params.{unknown[0]}",
                given[unknown[0]],
                f"not a sampling parameter; take {sorted(ROW_PARAMS)}",
            )
        room = self.max_seq_len - len(prompt_token_ids)
        if room < 1:
            rule = f"max_model_len={self.engine.max_model_len} (or the KV cache's {self.max_seq_len}) leaves no room"
            message = f"prompt has {len(prompt_token_ids)} tokens, but {rule} to generate"
            raise RequestError("prompt", len(prompt_token_ids), rule, message)
        max_tokens = given.get("max_tokens", room)
        if isinstance(max_tokens, int) and max_tokens > room:
            rule = f"a {len(prompt_token_ids)}-token prompt leaves room for {room} tokens (max_model_len)"
            raise RequestError("max_tokens", max_tokens, rule)
        fields = {k: v for k, v in given.items() if k != "stop"}
        if fields.get("structured_outputs") is not None:
            fields["structured_outputs"] = self._constraint(fields["structured_outputs"])
        return SamplingParams(**(self.defaults | fields | {"max_tokens": max_tokens}))

    def _constraint(self, value: str | dict[str, Any]) -> StructuredOutputsParams:
        """A row's ``structured_outputs``: a dict of StructuredOutputsParams' kinds (json, json_object, regex,
        choice, grammar) or its JSON text, which keeps rows whose constraints differ in shape in one Arrow column.
        A JSON schema's objects are closed as the server closes them (unless the engine's
        structured_outputs_disable_additional_properties is off); whether it compiles is the engine's check."""
        field = "sampling_params.structured_outputs"
        try:
            kinds = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as e:
            raise RequestError(field, value, f"neither a dict nor its JSON text ({e})") from None
        unknown = sorted(set(kinds) - set(CONSTRAINT_KINDS)) if isinstance(kinds, dict) else None
        if unknown is None or unknown:
            raise RequestError(field, value, f"a dict of one of {list(CONSTRAINT_KINDS)}")
        constraint = StructuredOutputsParams(**{k: v for k, v in kinds.items() if v is not None})
        if constraint.json is not None and self.close_objects:
            constraint = dataclasses.replace(constraint, json=closed_schema(constraint.json, True))
        return constraint

    async def _generate(
        self, prompt_token_ids: list[int], params: SamplingParams, given: dict[str, Any]
    ) -> tuple[list[_Sample], float | None, int]:
        stops = _stops(given)
        samples = [_Sample() for _ in range(params.n)]
        start, first_token_s, num_cached = time.monotonic(), None, 0
        stream = self.engine.generate(
            EngineRequest(
                request_id=f"batch-{uuid.uuid4().hex}", prompt_token_ids=prompt_token_ids, sampling_params=params
            )
        )
        async with aclosing(stream):  # leaving early (every sample stopped) aborts what still runs in the engine
            async for out in stream:
                s = samples[out.index]
                if s.finish_reason is not None:
                    continue
                if out.new_token_ids and first_token_s is None:
                    first_token_s = time.monotonic() - start
                s.token_ids += out.new_token_ids
                if out.new_logprobs:
                    s.logprobs = (s.logprobs or []) + [dataclasses.asdict(lp) for lp in out.new_logprobs]
                if stops and any(
                    stop in self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for stop in stops
                ):
                    s.finish_reason = "stop"
                elif out.finished:
                    s.finish_reason = out.finish_reason
                    s.error = out.error
                    num_cached = max(num_cached, out.num_cached_tokens)
                if all(x.finish_reason is not None for x in samples):
                    break
        return samples, first_token_s, num_cached


class DetokenizeStage:
    """Each choice's text (``generated_text`` is choice 0's), cut before the first stop string that matched, and
    the tokens of its logprobs as text (``token``, ``top_tokens``), so that writers need no tokenizer."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.tokenizer = load_tokenizer(engine_config, engine_config.resolved_model())

    def __call__(self, batch: pa.Table) -> pa.Table:
        return _table([self._row(r) for r in _rows(batch)])

    def _row(self, row: dict[str, Any]) -> dict[str, Any]:
        row = row | {"generated_text": None}
        if row["error"] is not None:
            return row
        stops = _stops(_given(row))
        for choice in row["choices"]:
            choice["text"] = self._text(choice["token_ids"], stops)
            for token_id, lp in zip(choice["token_ids"], choice["logprobs"] or ()):
                lp["token"] = self.tokenizer.decode([token_id])
                lp["top_tokens"] = [self.tokenizer.decode([t]) for t in lp["top_token_ids"]]
        row["generated_text"] = row["choices"][0]["text"]
        return row

    def _text(self, token_ids: list[int], stops: list[str]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        return text[:cut]
