"""examples/tool_agent.py: the program run as a subprocess on SmolLM2, and its loop driven
in-process: the forced first round yields calls of real functions with arguments their
models accept, every call is answered by a tool message with its id, then an answer."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from asyncgen import AsyncEngine

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "tool_agent.py"


@pytest.fixture(scope="module")
def agent():
    spec = importlib.util.spec_from_file_location("tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_program_calls_a_tool_then_answers():
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "What is the weather in Paris, in celsius?", "--max-tokens", "50",
         "--num-kv-blocks", "128"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = re.findall(r"^call> (\w+)\((.*)\) -> (.*)$", proc.stdout, re.M)
    assert calls, proc.stdout
    for name, args, result in calls:
        assert name in ("get_weather", "add")
        args, result = json.loads(args), json.loads(result)
        if isinstance(args, str):  # a call cut off by --max-tokens: its text, and the error the model is shown
            assert "invalid arguments" in result["error"]
        else:
            assert "error" not in result or "no weather data" in result["error"]
    assert re.search(r"^assistant> \S", proc.stdout, re.M), proc.stdout


def test_run_tool_reports_bad_calls_to_the_model(agent):
    assert agent.run_tool("get_weather", '{"city": "Paris", "unit": "fahrenheit"}') == {
        "city": "Paris", "temperature": 64.4, "unit": "fahrenheit", "sky": "sunny"}
    assert "no weather data" in agent.run_tool("get_weather", '{"city": "Atlantis", "unit": "celsius"}')["error"]
    assert agent.run_tool("add", '{"a": 2, "b": 2.5}') == {"sum": 4.5}
    assert agent.run_tool("rm", "{}") == {"error": "unknown tool 'rm'"}
    assert "invalid arguments" in agent.run_tool("add", '{"a": "two"}')["error"]


@pytest.mark.anyio
async def test_loop_answers_every_call_with_its_result(agent, smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_num_seqs=4, num_kv_blocks=256) as engine:
        for client, auto in ((engine.openai_client(), None), (engine.openai_client(tool_call_parser="hermes"), True)):
            log = []

            class Out:
                def write(self, s):
                    log.append(s)

                def flush(self):
                    pass

            messages = await agent.run_agent(client, "What is 2 + 3? Then tell me the weather in Oslo.", Out(),
                                             max_tokens=80, auto=auto)
            assert messages[-1]["role"] == "assistant" and messages[-1]["content"]
            calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", ())]
            results = [m for m in messages if m["role"] == "tool"]
            assert calls and [c["id"] for c in calls] == [r["tool_call_id"] for r in results]
            for call in calls:  # forced calls are well-formed calls of the real functions
                model, _ = agent.TOOLS[call["function"]["name"]]
                model.model_validate_json(call["function"]["arguments"])
            assert "".join(log).count("call> ") == len(calls)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


def test_a_forced_call_cut_off_by_max_tokens_is_reported_not_printed_as_the_answer():
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "What is the weather in Paris?", "--max-tokens", "4", "--num-kv-blocks", "128"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "assistant>" not in proc.stdout and "call>" not in proc.stdout
    assert "max_tokens=4 cut off the model's first tool call (length)" in proc.stderr
