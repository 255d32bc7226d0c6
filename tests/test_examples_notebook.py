"""examples/notebook.ipynb, executed top to bottom by nbclient in a real IPython kernel:
top-level ``await``, no nest_asyncio, the engine living across cells."""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "notebook.ipynb"


def _kernel_available(name: str) -> bool:
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        return name in KernelSpecManager().find_kernel_specs()
    except Exception:
        return False


def test_notebook_uses_top_level_await_without_nest_asyncio():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "nest_asyncio" not in code and "asyncio.run(" not in code
    assert "await engine.start()" in code and "async for" in code and "await engine.aclose()" in code
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"


def test_notebook_runs(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    kernel = nb.metadata.kernelspec.name
    if not _kernel_available(kernel):
        pytest.skip(f"no Jupyter kernel named {kernel!r} (pip install ipykernel)")
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = "MAX_TOKENS = 12"
    repo = str(EXAMPLES.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("ASYNCGEN_MODEL", raising=False)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    def stdout(cell) -> str:
        return "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")

    outputs = [stdout(c) for c in nb.cells if c.cell_type == "code"]
    assert not any(o.output_type == "error" for c in nb.cells for o in c.get("outputs", []))
    setup, stream, chat, many, openai_style, cleanup = outputs[1:]
    assert setup.startswith("SmolLM2-135M-Instruct EngineStats(")
    assert "finished because: length" in stream
    assert "Usage(prompt_tokens=" in chat
    assert many.count("## ") == 4 and "tokens/s" in many
    assert "completion_tokens=" in openai_style
    assert "num_running=0" in cleanup and cleanup.rstrip().endswith("engine running: False")
