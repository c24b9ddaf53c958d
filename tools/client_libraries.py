"""The client libraries agent frameworks point at an OpenAI-compatible server, tried against a running
`raylm serve` as their users call them: the openai SDK (chat, streams, parse, tools, the Responses API,
embeddings), instructor, langchain-openai, the OpenAI Agents SDK and LiteLLM. Each case prints ok or what
failed; a tool or JSON-schema case passes only when the reply ends in "stop" and validates (a schema left
open lets a small model add properties until max_tokens: issue #30).

The libraries are not raylm's dependencies; run it from a venv that has them:

    python -m venv /tmp/libs && /tmp/libs/bin/pip install openai instructor langchain-openai openai-agents litellm
    raylm serve --runner pooling &      # pooling: /v1/embeddings too
    /tmp/libs/bin/python tools/client_libraries.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
from collections.abc import Callable

from pydantic import BaseModel, Field


class City(BaseModel):
    """No integer field: JSON integers have no length bound in any grammar engine, and SmolLM2-135M greedy writes
    "population": 1111... until max_tokens (a model's failure the grammar permits, not the server's)."""

    name: str
    country: str
    capital: bool | None = None


class Weather(BaseModel):
    """The weather asked for: a city and a unit."""

    city: str = Field(description="the city")
    unit: str = Field("celsius", description="celsius or fahrenheit")


class Trip(BaseModel):
    origin: City
    destination: City
    stops: list[str]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": Weather.model_json_schema(),
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON with its name and country."}]


def openai_cases(url: str, model: str) -> dict[str, Callable[[], str]]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def chat() -> str:
        r = client.chat.completions.create(
            model=model, messages=ASK_CITY, max_tokens=20, logprobs=True, n=2, stop=["."]
        )
        assert len(r.choices) == 2 and r.choices[0].logprobs is not None and r.usage.completion_tokens > 0
        return r.choices[0].finish_reason

    def stream() -> str:
        chunks = list(
            client.chat.completions.create(
                model=model, messages=ASK_CITY, max_tokens=20, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage is not None and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)

    def parse() -> str:
        r = client.chat.completions.parse(model=model, messages=ASK_CITY, response_format=City, max_tokens=200)
        assert r.choices[0].message.parsed is not None
        return r.choices[0].finish_reason

    def forced_tool() -> str:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(
            model=model, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=200
        )
        call = r.choices[0].message.tool_calls[0]
        Weather.model_validate_json(call.function.arguments)
        follow = client.chat.completions.create(
            model=model,
            messages=[
                *ASK_WEATHER,
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
            ],
            max_tokens=30,
        )
        assert follow.choices[0].message.content
        return r.choices[0].finish_reason.replace("tool_calls", "stop")

    def streamed_tool() -> str:
        calls: dict[int, str] = {}
        finish = None
        for c in client.chat.completions.create(
            model=model,
            messages=ASK_WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            stream=True,
        ):
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                calls[d.index] = calls.get(d.index, "") + (d.function.arguments or "")
            finish = (c.choices[0].finish_reason if c.choices else None) or finish
        assert len(calls) == 1
        for arguments in calls.values():
            Weather.model_validate_json(arguments)
        return finish.replace("tool_calls", "stop")

    def responses() -> str:
        fmt = {"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}}
        first = client.responses.create(model=model, input="Describe Paris as JSON.", text=fmt, max_output_tokens=200)
        City.model_validate_json(first.output_text)
        tool = {"type": "function", "name": "get_weather", "parameters": Weather.model_json_schema()}
        second = client.responses.create(
            model=model,
            previous_response_id=first.id,
            input="And the weather there? Use the tool.",
            tools=[tool],
            tool_choice="required",
            max_output_tokens=200,
        )
        Weather.model_validate_json(next(o for o in second.output if o.type == "function_call").arguments)
        with client.responses.stream(model=model, input="Say hello.", max_output_tokens=10) as s:
            events = [e.type for e in s]
        assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
        return "stop" if first.status == second.status == "completed" else f"{first.status}/{second.status}"

    def models_and_embeddings() -> str:
        assert client.models.retrieve(model).id == model
        e = client.embeddings.create(model=model, input=["a cat", "a dog"])
        assert len(e.data) == 2 and len(e.data[0].embedding) > 0
        return "stop"

    return {
        "openai chat (logprobs, n, stop)": chat,
        "openai stream with usage": stream,
        "openai chat.completions.parse": parse,
        "openai forced tool call + tool result": forced_tool,
        "openai streamed tool call rebuilt (required, one call)": streamed_tool,
        "openai responses (schema, tools, previous_response_id, stream)": responses,
        "openai models.retrieve + embeddings": models_and_embeddings,
    }


def instructor_cases(url: str, model: str) -> dict[str, Callable[[], str]]:
    import instructor
    import openai

    def extract(mode) -> Callable[[], str]:
        def run() -> str:
            client = instructor.from_openai(
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300), mode=mode
            )
            trip, raw = client.chat.completions.create_with_completion(
                model=model,
                response_model=Trip,
                messages=[{"role": "user", "content": "A trip from Paris to Rome by train, as JSON."}],
                max_tokens=300,
                max_retries=0,
            )
            assert isinstance(trip, Trip)
            return "stop" if raw.choices[0].finish_reason in ("stop", "tool_calls") else raw.choices[0].finish_reason

        return run

    return {
        "instructor Mode.JSON_SCHEMA": extract(instructor.Mode.JSON_SCHEMA),
        "instructor Mode.TOOLS": extract(instructor.Mode.TOOLS),
    }


def langchain_cases(url: str, model: str) -> dict[str, Callable[[], str]]:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=model, max_tokens=200, max_retries=0, timeout=300)

    def bind_tools() -> str:
        reply = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Paris?")
        assert reply.tool_calls and not reply.invalid_tool_calls, reply
        Weather.model_validate(reply.tool_calls[0]["args"])
        return reply.response_metadata["finish_reason"].replace("tool_calls", "stop")

    def structured(method: str) -> Callable[[], str]:
        def run() -> str:
            out = llm.with_structured_output(City, method=method, include_raw=True).invoke("Describe Paris as JSON.")
            assert out["parsing_error"] is None and isinstance(out["parsed"], City), out
            return out["raw"].response_metadata["finish_reason"].replace("tool_calls", "stop")

        return run

    return {
        "langchain bind_tools": bind_tools,
        "langchain with_structured_output json_schema": structured("json_schema"),
        "langchain with_structured_output function_calling": structured("function_calling"),
    }


def agents_cases(url: str, model: str) -> dict[str, Callable[[], str]]:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    def run_with(model_class) -> Callable[[], str]:
        def run() -> str:
            calls.clear()
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            agent = Agent(
                name="weather",
                instructions="Answer with the weather tool.",
                tools=[get_weather],
                model=model_class(model=model, openai_client=client),
                model_settings=ModelSettings(tool_choice="required", max_tokens=200),
                tool_use_behavior="stop_on_first_tool",
            )
            result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
            assert calls and "sunny" in str(result.final_output), (calls, result.final_output)
            return "stop"

        return run

    return {
        "agents SDK, Responses model, function tool": run_with(OpenAIResponsesModel),
        "agents SDK, chat completions model, function tool": run_with(OpenAIChatCompletionsModel),
    }


def litellm_cases(url: str, model: str) -> dict[str, Callable[[], str]]:
    import litellm

    kw = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key="unused", max_tokens=200)

    def completion() -> str:
        r = litellm.completion(messages=ASK_CITY, **{**kw, "max_tokens": 20})
        assert r.choices[0].message.content
        return "stop" if r.choices[0].finish_reason in ("stop", "length") else r.choices[0].finish_reason

    def tools() -> str:
        r = litellm.completion(messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required", **kw)
        Weather.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
        return r.choices[0].finish_reason.replace("tool_calls", "stop")

    return {"litellm completion": completion, "litellm tools": tools}


LIBRARIES = {
    "openai": openai_cases,
    "instructor": instructor_cases,
    "langchain": langchain_cases,
    "agents": agents_cases,
    "litellm": litellm_cases,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--only", nargs="*", choices=sorted(LIBRARIES), help="these libraries only")
    args = parser.parse_args()
    failed = 0
    for name, cases in LIBRARIES.items():
        if args.only and name not in args.only:
            continue
        for case, run in cases(args.url, args.model).items():
            try:
                finish = run()
                ok = finish == "stop" or case in ("openai chat (logprobs, n, stop)", "openai stream with usage")
                print(f"{'ok  ' if ok else 'FAIL'} {case}: finish_reason={finish}", flush=True)
            except Exception as e:
                ok = False
                print(f"FAIL {case}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
            failed += not ok
    print(json.dumps({"failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
