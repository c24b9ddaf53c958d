"""`raylm bench structured`: structured outputs' validity over ten schemas, and their cost against free text."""

from __future__ import annotations

import argparse
import json
import time

from engine.cli_flags import add_engine_flags, llm_kwargs
from scheduler import SamplingParams, StructuredOutputsParams

_S = {"type": "string", "maxLength": 16}
_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = {
    "person": _OBJ
    | {
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
    },
    "address": _OBJ
    | {
        "properties": {"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"],
    },
    "colors": _OBJ
    | {
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
        },
        "required": ["colors"],
    },
    "order": _OBJ
    | {
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": _OBJ
                | {"properties": {"sku": _S, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]},
            },
        },
        "required": ["id", "items"],
    },
    "flags": _OBJ
    | {"properties": {"active": {"type": "boolean"}, "admin": {"type": "boolean"}}, "required": ["active", "admin"]},
    "measure": _OBJ
    | {"properties": {"value": {"type": "number"}, "unit": {"enum": ["m", "kg", "s"]}}, "required": ["value", "unit"]},
    "event": _OBJ
    | {
        "properties": {
            "title": _S,
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "tags": {"type": "array", "items": _S, "maxItems": 2},
        },
        "required": ["title", "date"],
    },
    "nested": _OBJ
    | {
        "properties": {
            "user": _OBJ | {"properties": {"name": _S, "email": _S}, "required": ["name"]},
            "score": {"type": "integer"},
        },
        "required": ["user", "score"],
    },
    "nullable": _OBJ
    | {
        "properties": {"note": {"anyOf": [_S, {"type": "null"}]}, "count": {"type": "integer"}},
        "required": ["note", "count"],
    },
    "pair": {"type": "array", "prefixItems": [_S, {"type": "integer"}], "items": False, "minItems": 2},
}
# For the cost comparison: an array that cannot close within the run's max_tokens, so every request masks at
# every step for exactly as many tokens as its unconstrained twin.
LONG_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": _OBJ | {"properties": {"id": {"type": "integer"}, "name": _S}, "required": ["id", "name"]},
}


def _prompt(llm, name: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": f"Give an example {name} as JSON."}])


def validity(llm, num_requests: int, max_tokens: int) -> tuple[int, int, int]:
    """(finished with stop, of those valid, finished with length) over num_requests spread across SCHEMAS."""
    import jsonschema

    names = list(SCHEMAS)
    prompts, params = [], []
    for i in range(num_requests):
        name = names[i % len(names)]
        prompts.append(_prompt(llm, name))
        params.append(
            SamplingParams(
                temperature=0.8,
                seed=i,
                max_tokens=max_tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
            )
        )
    stopped = valid = capped = 0
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        o = out.outputs[0]
        capped += o.finish_reason == "length"
        if o.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(o.text), SCHEMAS[names[i % len(names)]])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            print(f"    invalid ({names[i % len(names)]}): {o.text!r}: {e}")
    return stopped, valid, capped


def output_tok_s(llm, concurrency: int, max_tokens: int, constrained: bool) -> float:
    prompts = [_prompt(llm, "list of records") for _ in range(concurrency)]
    constraint = StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=constraint
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != concurrency * max_tokens:
        raise RuntimeError(f"{tokens} output tokens, expected {concurrency * max_tokens}: a request ended early")
    return tokens / elapsed


def bench_structured(
    model: str | None = None,
    num_requests: int = 200,
    concurrency: int = 64,
    max_tokens: int = 128,
    rounds: int = 3,
    **engine_kwargs,
) -> dict[str, float]:
    from engine.llm import LLM

    engine_kwargs.setdefault("max_num_seqs", concurrency)
    llm = LLM(model=model, **engine_kwargs)
    try:
        print(f"raylm bench structured: model {llm.engine.model_path}, device {llm.engine.device}")
        t0 = time.perf_counter()
        stopped, valid, capped = validity(llm, num_requests, 256)
        print(
            f"  validity: {num_requests} requests over {len(SCHEMAS)} JSON schemas in {time.perf_counter() - t0:.1f} s: "
            f"{stopped} finished with stop, {valid} of them valid ({valid / max(stopped, 1):.0%}); "
            f"{capped} cut by max_tokens=256"
        )
        output_tok_s(llm, concurrency, 8, True)  # warm-up: the library's tokenizer, first-call allocations
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):  # alternated, so that a slow spell of the machine hits both kinds alike
            for constrained in (False, True):
                runs[constrained].append(output_tok_s(llm, concurrency, max_tokens, constrained))
        free, forced = (sorted(runs[c])[len(runs[c]) // 2] for c in (False, True))
        print(
            f"  cost: {concurrency} concurrent requests x {max_tokens} output tokens, median of {rounds} alternated "
            f"rounds: unconstrained {free:.1f} output tok/s, JSON schema {forced:.1f} output tok/s "
            f"({forced / free:.0%}); each round: "
            + ", ".join(f"{a:.0f} / {b:.0f}" for a, b in zip(runs[False], runs[True]))
        )
        return {"stopped": stopped, "valid": valid, "free_tok_s": free, "schema_tok_s": forced}
    finally:
        llm.shutdown()


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=200, help="validity run, spread over ten schemas")
    p.add_argument("--concurrency", type=int, default=64, help="cost run: requests at once, each way")
    p.add_argument("--output-len", type=int, default=128, help="cost run: output tokens per request")
    add_engine_flags(p)


def main(args: argparse.Namespace) -> None:
    bench_structured(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        max_tokens=args.output_len,
        **llm_kwargs(args),
    )
