"""Variants of Triton's general attention kernel at a prefix-cache hit: registers,
spills and time.

The step is ``prefix_step_sweep.py``'s (78 new tokens over 992 cached, the engine's
prompt graph of ``--graph-tokens`` with 8 sequence slots, 7B shapes, fp16). Each variant
is the engine's kernel source with textual edits, loaded as its own module:

- ``off32``: the key and value offsets inside a layer's cache in int32 (block ids not
  widened to int64; the cache of one layer and kv head stays under 2**31 elements here);
- ``knat``: keys loaded as [keys, head_dim] tiles and transposed for the dot, instead of
  [head_dim, keys] tiles.

Each runs with the engine's split choice and with 2 and 8 splits, timed in a CUDA graph
over 8 KV caches; the compiled kernel's register count and spills are printed. The
script stops with an AssertionError when the kernel source no longer holds the lines
it edits.

    PYTHONPATH=. python3 benchmarks/attention_variants.py [--graph-tokens 80]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefix_step_sweep as pss  # noqa: E402

SOURCE = Path(__file__).resolve().parent.parent / "asyncgen" / "_ops" / "triton_paged_attention.py"
EDITS = {
    "off32": [
        ("offs_n // BLOCK_SIZE, mask=load_mask, other=0).to(tl.int64)", "offs_n // BLOCK_SIZE, mask=load_mask, other=0)"),
        ("offs_n // BLOCK_SIZE).to(tl.int64)", "offs_n // BLOCK_SIZE)"),
    ],
    "knat": [
        ("k_ptrs = k_base + (block_ids * stride_kb + slots * stride_ks)[None, :] + offs_d[:, None]  # [D, N]",
         "k_ptrs = k_base + (block_ids * stride_kb + slots * stride_ks)[:, None] + offs_d[None, :]  # [N, D]"),
        ("k = tl.load(k_ptrs, mask=load_mask[None, :], other=0.0)", "k = tl.load(k_ptrs, mask=load_mask[:, None], other=0.0)"),
        ("s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]",
         "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]"),
    ],
}


def load_variant(name: str, edits: list[str], workdir: Path):
    text = SOURCE.read_text()
    for edit in edits:
        for old, new in EDITS[edit]:
            assert text.count(old) == 1, f"the kernel source no longer holds {old!r}"
            text = text.replace(old, new)
    text = text.replace("from .triton_backend import", "from asyncgen._ops.triton_backend import")
    path = workdir / f"tpa_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"tpa_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled(module) -> list[tuple]:
    """(registers, spills) of each compiled variant of the module's general kernel."""
    out = []
    for entry in getattr(module._paged_attention_kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in cache.values():
            try:
                kernel._init_handles()
            except Exception:  # older Triton: handles already set
                pass
            out.append((getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph-tokens", type=int, default=80)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from asyncgen._ops.cuda_backend import graph_time_ms

    pss.GRAPH_TOKENS = args.graph_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, caches, tables, seq_lens, qsl = pss.attention_inputs(gen)
    scale = pss.HEAD_DIM**-0.5
    ref = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, edits in (("base", []), ("off32", ["off32"]), ("knat", ["knat"]), ("off32_knat", ["off32", "knat"])):
            module = load_variant(name, edits, Path(tmp))
            for splits in (None, 2, 8):
                def run(cache, out, module=module, splits=splits):
                    return module.paged_attention(q, cache[0], cache[1], tables, seq_lens, qsl, scale, out=out,
                                                  max_query_len=args.graph_tokens, max_seq_len=4096, num_splits=splits)

                got = run(caches[0], torch.empty_like(q))
                torch.cuda.synchronize()
                ref = got if ref is None else ref
                err = (got[: pss.NEW].float() - ref[: pss.NEW].float()).abs().max().item()
                outs = [torch.empty_like(q) for _ in caches]
                us = 1e3 * graph_time_ms(lambda call: call(), [lambda c=c, o=o: run(c, o) for c, o in zip(caches, outs)],
                                         passes=5)
                print(f"{name:12s} splits {splits}: {us:6.2f} us  err {err:.1e}  regs/spills {compiled(module)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
