"""On a CUDA machine: embeddings and beam search of the CUDA path equal transformers'.

The Llama-shaped random model of check_engine_cuda.py (head dim 128, fp32 in both).
Embeddings: ``engine.embed`` of prompts of 1-300 tokens, three after a cached 400-token
prefix, all at once beside generation requests (their steps run eagerly; the others'
replay CUDA graphs), against transformers' last hidden state at each prompt's last token.
Beam search: width 3, 8 tokens, against ``generate(num_beams=3)``. Each kernel backend
that imports is checked. Exits non-zero on any mismatch.

    python tests/gpu/check_pooling_beams_cuda.py --tokenizer DIR
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_engine_cuda import build  # noqa: E402


async def run_engine(path: Path, backend: str, prompts, beam_prompts):
    from asyncgen import AsyncEngine, BeamSearchParams, SamplingParams

    vectors: dict = {}
    gens: dict = {}
    async with AsyncEngine.from_pretrained(path, device="cuda", dtype="float32", ops_backend=backend, max_model_len=1024,
                                           num_kv_blocks=1024, max_num_batched_tokens=256) as engine:
        async def embed(i):
            vectors[i] = (await engine.embed(prompts[i], normalize=False)).embedding

        async def generate(i):
            gens[i] = (await engine.generate(prompts[i], SamplingParams(max_tokens=16, temperature=0))).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(embed, i)
                tg.start_soon(generate, i)
        beams = [await engine.beam_search(p, BeamSearchParams(beam_width=3, max_tokens=8)) for p in beam_prompts]
        stats = engine.stats()
    return vectors, beams, stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    from asyncgen._ops import cuda_backend_available

    backends = ["triton"] + (["cuda"] if cuda_backend_available() else [])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32000, (n,), generator=gen).tolist() for n in (1, 5, 17, 64, 129, 300)]
    prefix = torch.randint(0, 32000, (400,), generator=gen).tolist()
    prompts += [prefix + torch.randint(0, 32000, (n,), generator=gen).tolist() for n in (3, 30, 70)]
    beam_prompts = prompts[2:5]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        model = build(Path(d), Path(args.tokenizer), 128)
        with torch.no_grad():
            want = [model.model(torch.tensor([p], device="cuda")).last_hidden_state[0, -1].float().cpu() for p in prompts]
            hf_beams = []
            for p in beam_prompts:
                ids = torch.tensor([p], device="cuda")
                g = model.generate(ids, num_beams=3, num_return_sequences=3, max_new_tokens=8, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
                hf_beams.append(([row[len(p):].tolist() for row in g.sequences], g.sequences_scores.tolist()))
        eos = model.generation_config.eos_token_id
        del model
        torch.cuda.empty_cache()
        for backend in backends:
            vectors, beams, stats = anyio.run(run_engine, Path(d), backend, prompts, beam_prompts)
            worst = max(((torch.tensor(vectors[i]) - w).abs().max() / w.abs().max()).item() for i, w in enumerate(want))
            ok = worst < 1e-3
            print(f"backend={backend:6s} embeddings of {len(prompts)} prompts: worst relative difference {worst:.1e} "
                  f"(prefix-cache hits {stats.prefix_cache_hit_rate:.2f}) {'OK' if ok else 'MISMATCH'}", flush=True)
            failures += not ok
            for (want_seqs, want_scores), out in zip(hf_beams, beams):
                seqs = [list(s.token_ids) for s in out.sequences]
                want_seqs = [s[: s.index(eos) + 1] if eos in s else s for s in want_seqs]
                scores = [s.score for s in out.sequences]
                same = seqs == want_seqs
                close = all(abs(a - b) < 1e-3 for a, b in zip(scores, want_scores))
                print(f"backend={backend:6s} beam search: sequences {'equal' if same else 'DIFFER'}, scores "
                      f"{[round(s, 4) for s in scores]} against {[round(s, 4) for s in want_scores]}", flush=True)
                failures += not (same and close)
    print("pooling-and-beams-vs-transformers:", "PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
