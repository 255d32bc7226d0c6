"""A tool-using assistant: the model calls Python functions, sees their results, answers.

    python examples/tool_agent.py "What is the weather in Paris, in fahrenheit?" [--model DIR]

The tools are plain functions with pydantic models for their arguments; their JSON
Schemas go to the model as OpenAI ``tools``, through ``engine.openai_client()`` (the
``openai.AsyncOpenAI`` surface, in-process). Each round, the model's calls are checked
against the argument models, run, and their results sent back as ``tool`` messages. A
round that brings no call brings the answer (printed whole); after ``--max-rounds`` rounds
of calls, a last request streams the answer, tools off. An answer cut off by
``--max-tokens`` ends in " …"; a call it cut off (after a whole one) is run, and the model
shown the error its arguments give.

The first round forces a call (``tool_choice="required"``): the output is then
constrained to valid calls of these functions, which works with any model. If
``--max-tokens`` cuts that round off before one call is whole, there is no call to run:
the program says so and exits with status 1. Later rounds
let the model choose (``"auto"``) where asyncgen knows how the model writes calls (its
chat template names a format: Qwen, Hermes, Llama 3.1+, Mistral), and otherwise go
straight to the answer (``"none"``). The functions are ``strict``, so in those rounds a
model that writes Qwen's and Hermes' format also writes only valid calls. The bundled
SmolLM2-135M is far too small to use tools well, but what it calls is always a
well-formed call of a real function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Literal, Optional, TextIO

import anyio
from pydantic import BaseModel, Field, ValidationError

from asyncgen import AsyncEngine

# --- the tools: a function and the model of its arguments each ----------------------------------
WEATHER = {"paris": (18.0, "sunny"), "london": (12.5, "rain"), "tokyo": (21.0, "cloudy"), "oslo": (4.0, "snow")}


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=40, description="The city's name, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"] = Field(description="The temperature unit")


class Add(BaseModel):
    """The sum of two numbers."""

    a: float
    b: float


def get_weather(args: GetWeather) -> dict[str, Any]:
    found = WEATHER.get(args.city.strip().lower())
    if found is None:
        return {"error": f"no weather data for {args.city!r}; known cities: {', '.join(sorted(WEATHER))}"}
    celsius, sky = found
    temperature = celsius if args.unit == "celsius" else celsius * 9 / 5 + 32
    return {"city": args.city, "temperature": round(temperature, 1), "unit": args.unit, "sky": sky}


def add(args: Add) -> dict[str, Any]:
    return {"sum": args.a + args.b}


TOOLS: dict[str, tuple[type[BaseModel], Callable[[Any], dict[str, Any]]]] = {
    "get_weather": (GetWeather, get_weather),
    "add": (Add, add),
}


def tool_specs() -> list[dict[str, Any]]:
    """The tools in OpenAI's form: name, description, the arguments' JSON Schema, and
    ``strict`` (the arguments must follow the schema, also when the model chooses)."""
    return [
        {"type": "function", "function": {"name": name, "description": model.__doc__,
                                          "parameters": model.model_json_schema(), "strict": True}}
        for name, (model, _) in TOOLS.items()
    ]


def run_tool(name: str, arguments: str) -> dict[str, Any]:
    """Runs one call; a bad name or arguments become an error the model can read."""
    if name not in TOOLS:
        return {"error": f"unknown tool {name!r}"}
    model, fn = TOOLS[name]
    try:
        return fn(model.model_validate_json(arguments))
    except ValidationError as e:
        return {"error": f"invalid arguments: {e.errors(include_url=False)}"}


# --- the loop --------------------------------------------------------------------------------------
class CallCutOff(Exception):
    """The forced first round ended (at ``max_tokens``) before one tool call was whole."""


async def run_agent(
    client,
    question: str,
    out: TextIO = sys.stdout,
    *,
    max_rounds: int = 2,
    max_tokens: int = 200,
    auto: Optional[bool] = None,
) -> list[dict[str, Any]]:
    """Answers ``question`` with the tools; returns the conversation (OpenAI message dicts).
    ``auto``: whether later rounds may call tools (default: if the model has a tool-call format)."""
    if auto is None:
        auto = client.adapter.tool_call_parser is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer with the help of tools. Use them for facts and arithmetic."},
        {"role": "user", "content": question},
    ]
    for round_ in range(max_rounds):
        choice = "required" if round_ == 0 else "auto" if auto else None
        if choice is None:
            break
        resp = await client.chat.completions.create(
            model=client.model, messages=messages, tools=tool_specs(), tool_choice=choice,
            max_tokens=max_tokens, temperature=0,
        )
        message, finish = resp.choices[0].message, resp.choices[0].finish_reason
        if not message.tool_calls:
            if choice == "required":  # a forced round without a call: max_tokens cut the first one short
                raise CallCutOff(f"max_tokens={max_tokens} cut off the model's first tool call ({finish}): "
                                 f"{message.content!r}; allow more tokens")
            messages.append({"role": "assistant", "content": message.content or ""})
            print(f"assistant> {message.content or ''}{' …' if finish == 'length' else ''}", file=out)
            return messages
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"call> {call.function.name}({_one_line(call.function.arguments)}) -> {json.dumps(result)}", file=out)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    stream = await client.chat.completions.create(
        model=client.model, messages=messages, tools=tool_specs(), tool_choice="none",
        max_tokens=max_tokens, temperature=0, stream=True,
    )
    print("assistant> ", end="", file=out, flush=True)
    answer = []
    finish = None
    async with stream:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                answer.append(chunk.choices[0].delta.content)
                print(answer[-1], end="", file=out, flush=True)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    print(" …" if finish == "length" else "", file=out)
    messages.append({"role": "assistant", "content": "".join(answer)})
    return messages


def _one_line(arguments: str) -> str:
    """Arguments as compact JSON (as written if they are not JSON: a call cut off by max_tokens)."""
    try:
        return json.dumps(json.loads(arguments))
    except ValueError:
        return json.dumps(arguments)


def resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    if os.environ.get("ASYNCGEN_MODEL"):
        return os.environ["ASYNCGEN_MODEL"]
    from asyncgen.fetch import smollm2

    return str(smollm2())


async def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--max-rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    args = parser.parse_args(argv)
    async with AsyncEngine.from_pretrained(resolve_model(args.model), num_kv_blocks=args.num_kv_blocks) as engine:
        try:
            await run_agent(engine.openai_client(), args.question, max_rounds=args.max_rounds,
                            max_tokens=args.max_tokens)
        except CallCutOff as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(1) from None


if __name__ == "__main__":
    anyio.run(main)
