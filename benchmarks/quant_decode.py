"""Decode speed of a 4-bit AWQ model against the same-shaped fp16 model, through AsyncEngine.

Builds two Llama-2-7B-shaped checkpoints with random weights in a temporary directory:
an AWQ (GEMM format, 4-bit, group 128) one whose tensors are packed here exactly as
AutoAWQ writes them, and an fp16 one. Each is then served by its own process (so neither
sees the other's GPU memory) that measures

  (a) one stream's decode tokens/s (greedy, 256 tokens after a 32-token prompt), and
  (b) batch 64: 64 concurrent requests of 128 new tokens; output tokens/s overall, the
      median of three runs; and the same at batch 16 (no target: where 4-bit kernels on
      tensor cores are past their single-stream regime but the weights still dominate).

Targets: AWQ single stream >= 2.5x fp16; AWQ at batch 64 not slower than fp16.

Usage (a CUDA machine; no network)::

    PYTHONPATH=. python benchmarks/quant_decode.py --tokenizer DIR [--quick] [--layers N]

``--profile`` also prints each model's kernel times in one eager decode step at batch 1 and 64
(and a prompt step over a cached prefix), as ``h200_llama7b.py --profile`` does for fp16;
``--only awq`` (or ``fp16``) serves one of the two models.

DIR holds any tokenizer whose vocabulary covers ids < 32000 (SmolLM2's works); without
``--tokenizer`` a word-level tokenizer is written. ``--quick`` shrinks the model (4 layers)
and the runs for a smoke test; ``--device cpu`` runs that smoke test on the CPU (dense
path). Prints a table at the end and writes the numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
QUICK = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
GROUP_SIZE = 128


# --- checkpoints -----------------------------------------------------------------------------------------
def write_tokenizer(directory: Path, tokenizer_dir: str | None, vocab_size: int) -> None:
    if tokenizer_dir:
        skip = ("config.json", "generation_config.json", "model.safetensors.index.json")
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name not in skip and not f.name.endswith((".safetensors", ".bin", ".gguf")):
                shutil.copy(f, directory / f.name)
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    }))


def _config_json(cfg: dict, quant: dict | None) -> dict:
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2, **cfg}
    if quant:
        out["quantization_config"] = quant
    return out


def _awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit codes -> [R, N / 8] int32 in AWQ's field order (field p holds column
    8j + ORDER[p], ORDER = 0 2 4 6 1 3 5 7)."""
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7], device=codes.device)
    rows, n = codes.shape
    fields = codes.view(rows, n // 8, 8)[:, :, order].to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * 4
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_checkpoint(directory: Path, cfg: dict, awq: bool, device: str, tokenizer_dir: str | None) -> int:
    """Random weights (one safetensors file per layer); returns the bytes of the linear weights."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(0)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    weight_map, linear_bytes = {}, 0

    def save(tensors: dict, name: str) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(directory / name))
        weight_map.update({k: name for k in tensors})

    vocab = cfg["vocab_size"]
    save({
        "model.embed_tokens.weight": (torch.randn(vocab, h, generator=gen, device=device) * 0.02).half(),
        "model.norm.weight": torch.ones(h, dtype=torch.float16, device=device),
        "lm_head.weight": (torch.randn(vocab, h, generator=gen, device=device) * h**-0.5).half(),
    }, "embed.safetensors")
    for i in range(layers):
        t = {f"model.layers.{i}.input_layernorm.weight": torch.ones(h, dtype=torch.float16, device=device),
             f"model.layers.{i}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16, device=device)}
        for proj, (n, k) in shapes.items():
            name = f"model.layers.{i}.{proj}"
            if awq:
                groups = k // GROUP_SIZE
                codes = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.int32)
                zeros = torch.randint(6, 10, (groups, n), generator=gen, device=device, dtype=torch.int32)
                # (code - zero) has std ~4.6: scale so that one output has std ~1 for unit inputs.
                scales = torch.full((groups, n), 1.0 / (4.6 * k**0.5), device=device).half()
                t[f"{name}.qweight"], t[f"{name}.qzeros"], t[f"{name}.scales"] = _awq_pack(codes), _awq_pack(zeros), scales
                linear_bytes += k * n // 2 + 2 * groups * n * 2
            else:
                t[f"{name}.weight"] = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).half()
                linear_bytes += k * n * 2
        save(t, f"layer-{i:03d}.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"} if awq else None
    (directory / "config.json").write_text(json.dumps(_config_json(cfg, quant)))
    write_tokenizer(directory, tokenizer_dir, vocab)
    return linear_bytes


# --- one model, in its own process -----------------------------------------------------------------------
RESULT = "RESULT "  # the measuring process's last stdout line: this prefix, then its results as JSON


def report(res: dict) -> None:
    """Prints a measuring process's results for :func:`run_measuring`."""
    print(RESULT + json.dumps(res), flush=True)


def run_measuring(cmd: list[str]) -> tuple[dict | None, subprocess.CompletedProcess]:
    """Runs a measuring process; its reported results (None if it failed) and the process."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        return None, proc
    return json.loads(lines[-1][len(RESULT):]), proc


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that shape the written checkpoints (read back by :func:`model_config`)."""
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")


def model_config(base: dict, args: argparse.Namespace) -> dict:
    """``base`` with ``--layers`` applied."""
    cfg = dict(base)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    return cfg


async def measure(path: str, device: str, prompt_len: int, single_tokens: int, batches: tuple[int, ...],
                  batch_tokens: int, profile: bool = False) -> dict:
    import anyio

    from asyncgen import AsyncEngine, SamplingParams

    gen = torch.Generator().manual_seed(1)
    batch = max(batches)
    prompts = torch.randint(3, 32000, (batch, prompt_len), generator=gen).tolist()
    res = {}
    t0 = time.perf_counter()
    # (the profile's prompt step uses block ids past 1,000)
    kwargs = dict(gpu_memory_utilization=0.85) if device == "cuda" else dict(kv_cache_memory=1 << (30 if profile else 28))
    engine = AsyncEngine.from_pretrained(
        path, device=device, dtype="float16" if device == "cuda" else "float32",
        max_model_len=2048 if profile else 1024,  # the profile's prompt step has 1,070 tokens
        max_num_seqs=max(batch, 1), max_num_batched_tokens=max(4096, batch * prompt_len), **kwargs,
    )
    await engine.start()
    res["start_seconds"] = time.perf_counter() - t0
    try:
        async def run_batch(n_tokens: int, size: int = batch) -> tuple[float, int]:
            counts = []

            async def one(p):
                out = await engine.generate(p, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
                counts.append(len(out.outputs[0].token_ids))

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for p in prompts[:size]:
                    tg.start_soon(one, p)
            return time.perf_counter() - t, sum(counts)

        # Warm-up: every kernel configuration these runs reach is compiled here.
        await engine.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        await run_batch(8)

        # The tokens after the first chunk over the time from it to the last (a chunk may
        # carry more than one token).
        times, counts = [], []
        async for chunk in engine.stream(prompts[0], SamplingParams(max_tokens=single_tokens, temperature=0,
                                                                    ignore_eos=True)):
            times.append(time.perf_counter())
            counts.append(len(chunk.token_ids))
        res["single_stream_tokens_per_s"] = sum(counts[1:]) / (times[-1] - times[0])
        # Three runs, the median reported: one run is ~1 s and varied by up to 1.4x
        # between otherwise equal processes.
        for size in batches:
            rates = []
            for _ in range(3):
                seconds, tokens = await run_batch(batch_tokens, size)
                rates.append(tokens / seconds)
            res[f"batch{size}_tokens_per_s"] = sorted(rates)[1]
            res[f"batch{size}_runs_tokens_per_s"] = rates
        res["batch"] = batch
        if profile:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from h200_llama7b import profile_steps

            res["profile"] = await engine._device.run(profile_steps, engine)
    finally:
        await engine.aclose()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="quant_decode.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--profile", action="store_true", help="also print kernel times of one decode step")
    ap.add_argument("--only", choices=["awq", "fp16"], default=None, help="serve only this model")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one model's runs
    args = ap.parse_args()
    quick = args.quick or args.device == "cpu"
    prompt_len, single_tokens, batches, batch_tokens = (32, 32, (8,), 16) if quick else (32, 256, (16, 64), 128)
    batch = max(batches)
    if args.measure:
        import logging

        import anyio

        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")

        res = anyio.run(measure, args.measure, args.device, prompt_len, single_tokens, batches, batch_tokens,
                        args.profile)
        report(res)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 1
    cfg = model_config(QUICK if quick else LLAMA2_7B, args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="asyncgen-quant-"))
    results = {"config": cfg, "group_size": GROUP_SIZE, "torch": torch.__version__}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    try:
        for name, awq in (("awq", True), ("fp16", False)):
            if args.only and name != args.only:
                continue
            t0 = time.perf_counter()
            linear_bytes = write_checkpoint(work / name, cfg, awq, args.device, args.tokenizer)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"{name}: checkpoint written in {time.perf_counter() - t0:.0f} s "
                  f"(linear weights {linear_bytes / 1e9:.2f} GB)", flush=True)
            cmd = [sys.executable, __file__, "--measure", str(work / name), "--device", args.device]
            if args.quick:
                cmd.append("--quick")
            if args.profile:
                cmd.append("--profile")
            res, proc = run_measuring(cmd)
            if res is None:
                print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
                print(f"{name}: the measuring process failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            for line in proc.stderr.splitlines():  # the engine's choices at start
                if any(s in line for s in ("csrc GEMV", "4-bit kernels", "4-bit prompt", "in pieces", "KV cache", "CUDA graphs")):
                    print(f"{name}: {line}", flush=True)
            if args.profile:
                for line in proc.stdout.splitlines():
                    if not line.startswith(RESULT):
                        print(f"{name}: {line}", flush=True)
            results[name] = {**res, "linear_bytes": linear_bytes}
            summary = {k: v for k, v in results[name].items() if k != "profile"}
            print(f"{name}: {summary}", flush=True)
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    if args.only:
        return 0

    a, f = results["awq"], results["fp16"]
    key = f"batch{batch}_tokens_per_s"
    single_ratio = a["single_stream_tokens_per_s"] / f["single_stream_tokens_per_s"]
    batch_ratio = a[key] / f[key]
    print(f"\n=== AWQ 4-bit (group {GROUP_SIZE}) vs fp16, {cfg['num_hidden_layers']} layers x hidden {cfg['hidden_size']}, "
          f"{results.get('gpu', 'cpu')} ===")
    print(f"{'model':<6} {'weights GB':>10} {'start s':>8} {'single tok/s':>13} "
          + " ".join(f"{f'batch {b} tok/s':>15}" for b in batches))
    for name, r in (("awq", a), ("fp16", f)):
        print(f"{name:<6} {r['linear_bytes'] / 1e9:10.2f} {r['start_seconds']:8.1f} {r['single_stream_tokens_per_s']:13.1f} "
              + " ".join(f"{r[f'batch{b}_tokens_per_s']:15.1f}" for b in batches))
    others = "".join(f", batch {b} {a[f'batch{b}_tokens_per_s'] / f[f'batch{b}_tokens_per_s']:.2f}x"
                     for b in batches if b != batch)
    print(f"AWQ / fp16: single stream {single_ratio:.2f}x (target >= 2.5x), batch {batch} {batch_ratio:.2f}x "
          f"(target >= 1.0x){others}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
