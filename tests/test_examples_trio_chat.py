"""examples/trio_chat.py: the program run as a subprocess with a scripted conversation on
its standard input, and its chat loop driven in-process on trio (deadlines abort)."""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys
from contextlib import aclosing

import pytest

from asyncgen import AsyncEngine
from asyncgen.fetch import smollm2

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "trio_chat.py"
STATS = re.compile(r"\[(stopped after [\d.]+ s, )?(\d+) tokens, first after [\d.]+ s, [\d.]+ tokens/s\]")


def test_program_runs_a_scripted_conversation():
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    script = "What is 2+2?\n\n/reset\nName a color.\n/quit\nnever read\n"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--max-tokens", "12", "--temperature", "0", "--num-kv-blocks", "128"],
        input=script, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("assistant> ") == 2 and "(conversation cleared)" in out and "never read" not in out
    assert "you> What is 2+2?" in out and "you> Name a color." in out
    stats = STATS.findall(out)
    assert len(stats) == 2 and all(0 < int(n) <= 12 for _, n in stats)


@pytest.fixture
def anyio_backend():
    return "trio"


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("trio_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def scripted(*lines):
    for line in lines:
        yield line


@pytest.mark.anyio
async def test_chat_keeps_history_and_deadlines_abort(example):
    async with AsyncEngine.from_pretrained(smollm2(), num_kv_blocks=128, max_model_len=2048) as engine:
        out = io.StringIO()
        history = await example.chat(
            engine, scripted("Hi, I am Ada.", "Tell me a very long story about dragons."), out,
            max_tokens=1000, temperature=0, timeout=1.5,
        )
        assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
        text = out.getvalue()
        stopped = re.findall(r"\[stopped after 1.5 s, (\d+) tokens", text)
        assert stopped and all(int(n) < 1000 for n in stopped)  # the long story was cut by the deadline
        s = engine.stats()
        assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks

        out = io.StringIO()
        async with aclosing(scripted("word " * 3000, "/quit", "never read")) as lines:
            history = await example.chat(engine, lines, out, max_tokens=4)
        assert "(error:" in out.getvalue() and history == [{"role": "system", "content": example.SYSTEM}]


def test_ctrl_c_mid_answer_leaves_without_a_traceback():
    from conftest import interrupt_after

    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(EXAMPLE), "--max-tokens", "400", "--num-kv-blocks", "128"]
    # Ctrl+C once the answer has started
    status, err = interrupt_after(cmd, b"assistant> ", env, stdin=b"Tell me a long story about a lighthouse.\n")
    assert status == 130 and b"Traceback" not in err, err.decode(errors="replace")[-3000:]
    assert err.strip().endswith(b"interrupted")
