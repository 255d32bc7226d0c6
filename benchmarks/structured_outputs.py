"""What structured outputs cost: the same decode work with and without a JSON Schema.

A batch of ``--batch`` chat requests asks for a JSON object of a fixed schema (a pet:
name, kind, age, vaccinated, owner, tags), sampled at temperature 0.8 with one seed each.
Then the same requests run again without the schema, each with ``max_tokens`` set to the
number of tokens its structured run produced and ``ignore_eos=True``, so both runs decode
exactly the same number of tokens in the same batch shapes. The difference is the
structured run's work: its masks (memoized per grammar state) and applying them, and
sampling each step only once the previous one's tokens are on the host (the forward
pass is still launched ahead). A third run of the unconstrained requests adds
``repetition_penalty=1.1`` and ``frequency_penalty=0.2``, which read earlier tokens on
the host in the same way.

Also timed: the first structured request of a fresh engine (it reads the vocabulary's
bytes and builds its byte trie), and the same request again (masks already memoized).

    python benchmarks/structured_outputs.py                       # SmolLM2 on the CPU
    python benchmarks/structured_outputs.py --model DIR --device cuda --dtype float16 --batch 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio

from asyncgen import AsyncEngine, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer"},
        "vaccinated": {"type": "boolean"},
        "owner": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "kind", "age", "vaccinated", "owner", "tags"],
}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON: name, kind, age, vaccinated, owner and tags."}]


async def _batch(engine, params_list):
    outs = [None] * len(params_list)

    async def one(i, p):
        outs[i] = await engine.generate(messages=MESSAGES, params=p)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(params_list):
            tg.start_soon(one, i, p)
    return time.perf_counter() - t0, outs


async def main(args) -> dict:
    kw = dict(max_model_len=2048, device=args.device, dtype=args.dtype)
    if args.num_kv_blocks:
        kw["num_kv_blocks"] = args.num_kv_blocks
    async with AsyncEngine.from_pretrained(args.model, **kw) as engine:
        guided = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
        t0 = time.perf_counter()
        first = await engine.generate(messages=MESSAGES, params=guided)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        await engine.generate(messages=MESSAGES, params=guided)
        warm = time.perf_counter() - t0
        plain_one = SamplingParams(temperature=0, max_tokens=len(first.token_ids), ignore_eos=True)
        t0 = time.perf_counter()
        await engine.generate(messages=MESSAGES, params=plain_one)
        unguided_one = time.perf_counter() - t0
        rows = []
        for rep in range(args.repeats):
            structured = [
                SamplingParams(temperature=0.8, seed=1000 * rep + i, max_tokens=args.max_tokens,
                               structured_outputs={"json": SCHEMA})
                for i in range(args.batch)
            ]
            t_s, outs = await _batch(engine, structured)
            valid = sum(o.finish_reason == "stop" and _parses(o.text) for o in outs)
            plain = [
                SamplingParams(temperature=0.8, seed=1000 * rep + i, max_tokens=len(o.token_ids), ignore_eos=True)
                for i, o in enumerate(outs)
            ]
            t_p, _ = await _batch(engine, plain)
            penalised = [p.model_copy(update={"repetition_penalty": 1.1, "frequency_penalty": 0.2}) for p in plain]
            t_pen, _ = await _batch(engine, penalised)
            tokens = sum(len(o.token_ids) for o in outs)
            rows.append({"tokens": tokens, "structured_s": t_s, "plain_s": t_p, "penalised_s": t_pen, "valid": valid})
            print(f"run {rep}: {tokens} tokens; structured {t_s:.2f} s ({tokens / t_s:.1f} tok/s, {valid}/{len(outs)} "
                  f"valid and complete); same tokens unconstrained {t_p:.2f} s ({tokens / t_p:.1f} tok/s), "
                  f"with penalties {t_pen:.2f} s ({tokens / t_pen:.1f} tok/s)")
    ratio = statistics.median(r["structured_s"] / r["plain_s"] for r in rows)
    pen_ratio = statistics.median(r["penalised_s"] / r["plain_s"] for r in rows)
    print(f"first structured request of the engine: {cold * 1000:.0f} ms for {len(first.token_ids)} tokens; "
          f"again: {warm * 1000:.0f} ms; the same {len(first.token_ids)} tokens unconstrained: "
          f"{unguided_one * 1000:.0f} ms")
    print(f"batch of {args.batch}: structured / unconstrained time, median of {len(rows)}: {ratio:.3f}; "
          f"with penalties / unconstrained: {pen_ratio:.3f}")
    return {"cold_s": cold, "warm_s": warm, "unguided_one_s": unguided_one, "first_tokens": len(first.token_ids),
            "runs": rows, "median_time_ratio": ratio, "median_penalised_ratio": pen_ratio, "batch": args.batch}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct, fetched once)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.model is None:
        from asyncgen.fetch import smollm2

        args.model = str(smollm2())
    result = anyio.run(main, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
