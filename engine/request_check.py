"""The one check of a request, at the engine boundary: both executors run it once on the EngineRequest their
caller made, in add_request (and RayEngine in generate), before anything is scheduled, so that one bad request never fails a step the
others share. Every refusal is a RequestError naming the field, its value and the rule; the server turns
it into a 400 whose ``param`` is that field, offline it is the ValueError the caller sees."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from scheduler import EngineRequest, RequestError, SamplingParams, StructuredOutputsParams
from workers.grammars import compile_grammar

if TYPE_CHECKING:  # torch and the model stack: seconds of import that `raylm serve`'s own process never needs
    from workers.model_spec import ModelSpec

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def check_request(request: EngineRequest, spec: ModelSpec, max_model_len: int) -> EngineRequest:
    """The request as the engine runs it (a copy: its params' stop_token_ids with the model's extra EOS ids, its
    constraint compiled), or RequestError. What SamplingParams checks alone it checked when it was built; here is
    what needs the model."""
    params = request.sampling_params
    if not isinstance(params, SamplingParams):
        raise RequestError("params", params, "must be a SamplingParams")
    check_prompt(request.prompt_token_ids, spec.vocab_size, max_model_len)
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        if (bad := next((t for t in ids if t >= spec.vocab_size), None)) is not None:
            raise RequestError(name, bad, f"token id outside the vocabulary [0, {spec.vocab_size})")
    if params.dimensions is not None:
        check_dimensions(params.dimensions, spec)
    if params.structured_outputs is not None:
        compiled = check_constraint(params.structured_outputs)
        params = dataclasses.replace(
            params, structured_outputs=dataclasses.replace(params.structured_outputs, compiled=compiled)
        )
    return dataclasses.replace(request, sampling_params=with_eos_stop_token_ids(params, spec))


def check_dimensions(dimensions: int, spec: ModelSpec) -> None:
    """An embedding is shortened only where the model was trained for it (matryoshka, vLLM's rule); its own
    width is always served."""
    width = spec.hidden_size
    if dimensions == width:
        return
    if not spec.is_matryoshka:
        rule = f"this model's embeddings have {width} dimensions and it is no matryoshka model (config.json says"
        raise RequestError("dimensions", dimensions, rule + " neither is_matryoshka nor matryoshka_dimensions)")
    allowed = spec.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        raise RequestError("dimensions", dimensions, f"this model serves the widths {list(allowed)} (and {width})")
    if dimensions > width:
        raise RequestError("dimensions", dimensions, f"this model's embeddings have {width} dimensions")


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt_token_ids:
        raise RequestError("prompt", prompt_token_ids, "it must have at least one token")
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError(f"prompt[{i}]", t, f"token id outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise RequestError(
            "prompt",
            len(prompt_token_ids),
            f"max_model_len={max_model_len} leaves no room",
            f"prompt has {len(prompt_token_ids)} tokens, but max_model_len={max_model_len} leaves no room to generate",
        )


def check_constraint(c: StructuredOutputsParams) -> str:
    """The constraint's grammar, compiled here and only here: the sampling rank builds its matcher from it, and
    one that failed there would fail the whole step."""
    kind = next(k for k in CONSTRAINT_KINDS if getattr(c, k) not in (None, False))
    try:
        return compile_grammar(c)
    except ValueError as e:
        field, rule = f"structured_outputs.{kind}", f"it does not compile: {str(e).removeprefix(kind + ': ')}"
        raise RequestError(field, getattr(c, kind), rule, f"{field}: {rule}") from None  # a schema may be long


def with_eos_stop_token_ids(params: SamplingParams, spec: ModelSpec) -> SamplingParams:
    """``params`` stopping on every EOS id of the model: models with several (generation_config) stop on any of
    them, as transformers does."""
    extra = [t for t in spec.eos_token_ids if t != spec.eos_token_id and t not in params.stop_token_ids]
    if not extra or params.ignore_eos:
        return params
    return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
