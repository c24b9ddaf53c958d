"""/v1/embeddings' work on a replica: the inputs checked as prompts, each embedded as one request of its own (the
scheduler batches them with everything else in flight)."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from scheduler import EngineRequest, RequestError, SamplingParams
from serve.admission import Admission
from serve.generation import engine_error, engine_unavailable
from serve.metrics import ServeMetrics
from serve.prompts import prompt_ids
from serve.protocol.output import new_id
from serve.protocol.parsing import APIError, bad_request
from serve.served_models import ServedModels


def embedding_prompts(tokenizer: Any, inputs: list, max_seq_len: int, max_model_len: int) -> list[list[int]]:
    """Each input's token ids; 400 naming ``input[i]`` for one with no tokens or too many."""
    prompts = [prompt_ids(tokenizer, p) for p in inputs]
    for i, ids in enumerate(prompts):
        param = "input" if len(prompts) == 1 else f"input[{i}]"
        if not ids:
            raise bad_request(f"{param}: the text has no tokens", param)
        if len(ids) >= max_seq_len:
            raise bad_request(
                f"{param} has {len(ids)} tokens: this server embeds at most {max_seq_len - 1} "
                f"(max_model_len={max_model_len})",
                param,
                "context_length_exceeded",
            )
    return prompts


async def embed(
    admission: Admission,
    metrics: ServeMetrics,
    served: ServedModels,
    prompt: list[int],
    params: SamplingParams,
    lora_name: str | None,
) -> list[float]:
    """One input's embedding; the engine's refusal a 400 naming the input (or a 404 for an adapter gone)."""
    arrival = time.monotonic()
    try:
        stream = admission.generate(
            EngineRequest(
                request_id=new_id("embd"), prompt_token_ids=prompt, sampling_params=params, lora_name=lora_name
            )
        )
        async with aclosing(stream):
            async for out in stream:
                if out.finished:
                    break
    except RequestError as e:  # the engine's check: the prompt is the request's input
        param = "input" if e.field.startswith("prompt") else e.field
        raise await served.unloaded(e) or bad_request(str(e), param) from None
    except APIError:
        raise
    except Exception as e:  # the engine's actors are gone, or the replica is draining
        raise engine_error(e, "the engine failed") from None
    if out.embedding is None:
        raise engine_unavailable(f"the engine failed: {out.error or out.finish_reason}")
    metrics.embedded(len(prompt), arrival, time.monotonic(), out.queued_s)
    return out.embedding
