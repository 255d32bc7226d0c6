"""On a CUDA machine: ``aclose()`` gives the engine's GPU memory back.

Builds a small Llama-shaped model with random weights, then three times: starts an
engine that fills half the GPU with KV blocks (``gpu_memory_utilization=0.5``),
generates, closes it, and compares the memory torch holds (allocated and reserved) and
the device's free memory with the figures from before the first start. What may stay
held is what torch and CUDA keep for the process (cuBLAS workspaces, loaded libraries),
and it must not grow from one engine to the next. Exits non-zero otherwise.

    python tests/gpu/check_aclose_memory.py --tokenizer DIR
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import anyio
import torch

MiB = 2**20


def build(directory: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)


def snapshot() -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "free": free}


async def one_engine(path: Path) -> tuple[dict, dict]:
    from asyncgen import AsyncEngine, SamplingParams

    engine = AsyncEngine.from_pretrained(path, device="cuda", dtype="float16", max_model_len=2048,
                                         gpu_memory_utilization=0.5, ops_backend="triton")
    await engine.start()
    out = await engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8
    running = snapshot()
    await engine.aclose()
    del engine
    gc.collect()
    return running, snapshot()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    args = ap.parse_args()
    torch.cuda.init()
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        build(Path(d), Path(args.tokenizer))
        before = snapshot()
        print(f"before: allocated {before['allocated'] / MiB:.0f} MiB, reserved {before['reserved'] / MiB:.0f} MiB, "
              f"device free {before['free'] / MiB:.0f} MiB")
        for i in range(3):
            running, after = anyio.run(one_engine, Path(d))
            print(f"engine {i}: running allocated {running['allocated'] / MiB:.0f} MiB, device free "
                  f"{running['free'] / MiB:.0f} MiB; after aclose allocated {after['allocated'] / MiB:.0f} MiB, "
                  f"reserved {after['reserved'] / MiB:.0f} MiB, device free {after['free'] / MiB:.0f} MiB")
            held = after["allocated"] - before["allocated"]
            lost = before["free"] - after["free"]
            # What may stay: torch's cuBLAS workspaces (allocated through its caching allocator,
            # kept for the process) and the CUDA libraries loaded on first use. Neither may grow
            # from one engine to the next.
            ok = held <= 128 * MiB and after["reserved"] - before["reserved"] <= 128 * MiB and lost <= 512 * MiB
            ok = ok and running["allocated"] - before["allocated"] > 1024 * MiB  # it really held memory
            if i == 0:
                first_after = after
            else:
                ok = ok and abs(after["allocated"] - first_after["allocated"]) <= MiB
                ok = ok and abs(after["free"] - first_after["free"]) <= 16 * MiB
            print(f"  held after aclose {held / MiB:.1f} MiB, device memory not returned {lost / MiB:.0f} MiB: "
                  f"{'OK' if ok else 'FAIL'}")
            failures += not ok
    print("aclose-memory:", "PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
