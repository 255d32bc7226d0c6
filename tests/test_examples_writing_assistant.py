"""examples/writing_assistant.py: several users' documents streamed concurrently from
SmolLM2 (small max_tokens), with per-request time to first token and tokens/s."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import re

import pytest

from asyncgen.fetch import smollm2

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "writing_assistant.py"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the example's default event loop


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("writing_assistant", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_many_documents_at_once(example, tmp_path, capsys):
    users = 6
    results = await example.amain([
        "--model", str(smollm2()), "--users", str(users), "--max-tokens", "16", "--num-kv-blocks", "256",
        "--out", str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert [r.kind for r in results] == [k for _, k, _ in example.REQUESTS[:users]]
    for r in results:
        assert r.text and 0 < r.tokens <= 16 and r.finish_reason in ("stop", "length")
        assert 0 < r.ttft <= r.total and r.tokens_per_s >= 0
    # all documents were in flight together: every first token came before any document ended
    assert max(r.ttft for r in results) < min(r.total for r in results)

    rows = re.findall(r"^(\w+)\s+([a-zA-Z ]+?)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)  (stop|length)$", out, re.M)
    assert [row[0] for row in rows] == [r.user for r in results]
    assert f"{users} documents, {sum(r.tokens for r in results)} tokens in" in out
    assert "time to first token: mean" in out
    assert len(re.findall(r"^\[\s*[\d.]+ s\] \w+'s ", out, re.M)) == users
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == users and "alice-blog-post.md" in files
    assert (tmp_path / "alice-blog-post.md").read_text().startswith("# Blog post for alice\n\n")


@pytest.mark.parametrize("flags, named", [
    (["--max-tokens", "3000"], "--max-tokens must be at least 1 and leave room"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--users", "-2"], "--users must be 0 or more"),
])
def test_flags_out_of_range_are_refused_before_loading(example, flags, named, capsys):
    with pytest.raises(SystemExit) as info:
        example.main(flags)
    assert info.value.code == 2 and named in capsys.readouterr().err


def test_ctrl_c_leaves_without_a_traceback():
    import os

    from conftest import interrupt_after

    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE.parents[1]), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(EXAMPLE), "--users", "3", "--max-tokens", "500"]
    status, err = interrupt_after(cmd, b"users, up to", env, delay=1.0)  # a second into the requests
    assert status == 130 and b"Traceback" not in err, err.decode(errors="replace")[-3000:]
