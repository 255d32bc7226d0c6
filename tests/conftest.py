"""Shared fixtures: the real SmolLM2 model, tiny random-weight models, anyio backends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels are tested on the CPU through the interpreter; it must be switched on
# before any kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from asyncgen.fetch import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' model and tokenizer on the same weights, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def save_tiny_model(directory: Path, arch: str, tokenizer_dir: Path, **overrides) -> Path:
    """Saves a random-weight model of ``arch`` with SmolLM2's tokenizer into ``directory``."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # a wider spread than the default init, so logits differ visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(1.0, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def forward_in_chunks(model, ids, chunks, block_size=4):
    """Logits of ``ids`` from the paged model, run in the given (start, end) chunks over a
    NaN-filled cache whose blocks are scattered."""
    import torch

    from asyncgen.model.llama import AttentionMetadata

    cfg = model.cfg
    num_blocks = 64
    for layer in model.layers:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        layer.self_attn.k_cache = torch.full(shape, float("nan"))
        layer.self_attn.v_cache = torch.full(shape, float("nan"))
    n = ids.shape[0]
    table = torch.randperm(num_blocks)[: -(-n // block_size)].to(torch.int32)
    pos = torch.arange(n)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    logits = []
    for s, e in chunks:
        meta = AttentionMetadata(
            slots[s:e], table.unsqueeze(0), torch.tensor([e], dtype=torch.int32),
            torch.tensor([0, e - s], dtype=torch.int32), e - s, e,
        )
        logits.append(model.compute_logits(model(ids[s:e], pos[s:e], meta)))
    return torch.cat(logits)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_path)


# --- SmolLM2's vocabulary for structured-output tests ---------------------------------------------
@pytest.fixture(scope="session")
def token_bytes(smollm2_path):
    from asyncgen.engine.tokenizer import TokenBytes, load_tokenizer

    tokenizer, _ = load_tokenizer(smollm2_path)
    return TokenBytes(tokenizer).vocabulary()


@pytest.fixture(scope="session")
def vocabulary(token_bytes):
    from asyncgen.structured import Vocabulary

    return Vocabulary(token_bytes)


@pytest.fixture(scope="session")
def closers(token_bytes):
    """Token groups a walk prefers, in order: tokens that close a container, then a string."""
    groups = ([], [])
    for i, data in enumerate(token_bytes):
        if data and (b"}" in data or b"]" in data):
            groups[0].append(i)
        elif data and b'"' in data:
            groups[1].append(i)
    return groups


def assert_idle(engine) -> None:
    """Nothing running or waiting, and every KV block free."""
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)


def interrupt_after(cmd: list[str], marker: bytes, env: dict, stdin: bytes = b"", delay: float = 0.0):
    """Runs ``cmd``, writes ``stdin`` to it, sends SIGINT (Ctrl+C) ``delay`` seconds after
    ``marker`` appears in its output; returns (exit status, standard error)."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        if stdin:
            proc.stdin.write(stdin)
            proc.stdin.flush()
        seen = b""
        deadline = time.monotonic() + 300
        while marker not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            seen += os.read(proc.stdout.fileno(), 4096)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err
