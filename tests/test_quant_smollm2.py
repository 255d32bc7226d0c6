"""SmolLM2-135M-Instruct quantized by GPTQModel itself (GPTQ and AWQ), served by asyncgen.

The checkpoints are made once and kept in ``<asyncgen cache>/quant/`` (keyed by the
recipe and the GPTQModel version), so only the first run pays for quantizing (about
10 minutes on 2 CPU cores, see docs/QUANTIZATION.md); the tool runs in a subprocess of
the interpreter that has it (see ``tool_python`` in ``test_quant_formats``). Then:

- asyncgen's loaded weights equal GPTQModel's own dequantization of the same files;
- both checkpoints generate coherent text through ``AsyncEngine``;
- their perplexity on a fixed passage is within 10 % of the fp16 model's.

Everything that needs the tool or a quantized checkpoint is marked ``slow``. Without
gptqmodel these tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import anyio
import pytest
import torch

from asyncgen import AsyncEngine, SamplingParams
from asyncgen._ops import get_ops
from asyncgen.fetch import cache_root
from asyncgen.model.config import ModelConfig
from asyncgen.model.llama import AttentionMetadata, LlamaForCausalLM
from asyncgen.model.loader import load_weights
from asyncgen.model.quantization import linear_method_factory

from test_quant_formats import loaded_weights, require_tool_python, run_tool_dequant  # noqa: E402

pytestmark = pytest.mark.slow

# Plain prose, none of it among the calibration topics. It is several paragraphs long
# because a short text measures little: over its first paragraph alone (151 tokens) the
# ratio to fp16 moved by +-5 % between near-identical recipes, a handful of tokens
# carrying most of the difference.
PASSAGE = "\n\n".join([
    "The old lighthouse stood at the edge of the cliff for more than a century. Every evening the keeper climbed "
    "the narrow spiral stairs, trimmed the wick and polished the great glass lens until it shone. Ships passing in "
    "the night relied on its steady beam to steer clear of the rocks below. When the keeper grew old, his daughter "
    "took over the work. She kept a careful log of the weather, the passing ships and the birds that nested in the "
    "walls. Years later the light was replaced by an automatic lamp, and the keepers left the island for good. "
    "Today visitors can walk up the same stairs, read the old logbooks in a small museum, and look out over the sea "
    "where so many sailors once searched the darkness for that reassuring flash of light.",
    "Every spring the river below the town rises with melted snow from the hills. For a few weeks the water runs "
    "brown and fast, carrying branches and the occasional fence post past the old stone bridge. Children gather on "
    "the bank after school to watch, and their parents warn them not to go too close to the edge. By the start of "
    "summer the river is calm again, clear enough to see the fish holding still against the current.",
    "My grandmother kept a small notebook in which she wrote down every recipe she cooked. Some pages were stained "
    "with butter and flour, and a few had notes in the margins saying which guests had liked the dish and which had "
    "left it on the plate. When she died, the notebook passed to my mother, who still uses it every Sunday. She "
    "says the bread never tastes quite the same, but nobody else in the family can tell the difference.",
    "The library in our neighbourhood opened in a converted train station. The ticket hall became the reading room, "
    "and the old platform now holds a garden with benches where people sit with their books in good weather. On "
    "Saturday mornings a volunteer reads stories to young children, who sit on cushions in a circle and ask endless "
    "questions about the pictures. In the evenings the building hosts classes on everything from computer skills to "
    "watercolour painting.",
    "The bus to the coast left the station at seven in the morning, and by eight it had climbed out of the valley "
    "into open farmland. Most of the passengers slept or looked at their phones. An old man near the front pointed "
    "out the landmarks to anyone who would listen: the church where he had married, the field where a plane had "
    "once landed in a storm, the shop that had sold the best ice cream for forty years before it closed.",
    "Learning a new language as an adult is slow, and progress often feels invisible. For weeks nothing seems to "
    "change, and then one day you understand a joke on the radio or follow a conversation at the next table without "
    "trying. Teachers say the secret is to practise a little every day rather than a lot once a week, and to accept "
    "that mistakes are part of the process rather than a sign of failure.",
    "In the winter the pond behind the school freezes over, though rarely thick enough to walk on. The caretaker "
    "puts up a sign every December warning children to stay off the ice, and every year someone tests it anyway. "
    "Most of the time they get nothing worse than wet shoes and a telling-off, but the story of the boy who fell "
    "through in the cold winter of 1963 is still told in the staff room.",
])

# How each checkpoint is made: GPTQModel's config arguments, plus the dtype it computes
# in and how many calibration texts it sees. Both 4-bit, asymmetric, group 32 (with
# group 64 this 135M model measured 8-17 % above fp16 on PASSAGE, with group 32 5-9 %).
# GPTQ: act-order with asymmetric (v1-stored) zero points, so the real checkpoint
# exercises g_idx and the zero-minus-one convention; computed in fp32 (GPTQModel picks
# bf16 on CPUs, about 6x slower than fp32 where the CPU has no bf16 units; its packer
# stores fp16 scales either way). AWQ: GEMM format, computed in fp16 (its packer takes
# fp16 or bf16 only); AWQ needs fewer calibration tokens than GPTQ's Hessians.
RECIPES = {
    "gptq": {
        "kind": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False, "dtype": "float32", "num_texts": 48,
    },
    "awq": {"kind": "awq", "bits": 4, "group_size": 32, "sym": False, "dtype": "float16", "num_texts": 16},
}
# Calibration text is written by the fp16 model itself (one sampled answer per topic):
# no dataset download, and in the model's own distribution, which a 135M model needs
# (calibrated on technical text, its GPTQ perplexity on plain prose is worse than
# round-to-nearest's). The passage above is not among the topics.
CALIBRATION = {
    "topics": [
        "a village market on a Saturday morning", "how bridges are built", "the history of the printing press",
        "a storm at sea", "learning to play the piano", "how bees make honey", "a detective solving a small mystery",
        "the water cycle", "planning a vegetable garden", "the first day at a new school",
        "how computers store numbers", "a train journey through the mountains", "a family moving to a new town",
        "cooking soup for friends", "why the sky is blue", "a letter to an old friend", "the rules of chess",
        "a walk through a forest in autumn", "how vaccines work", "a small bakery in a big city",
        "the invention of the telephone", "caring for a pet dog", "the planets of the solar system",
        "a football match in the rain", "how to write a good essay", "a trip to a science museum",
        "the migration of birds", "a recipe for apple pie", "how rivers shape valleys", "the job of a librarian",
        "building a wooden boat", "a quiet evening at home", "the causes of the French Revolution",
        "a robot that learns to paint", "how airplanes fly", "saving money for the first time",
        "a mountain village in winter", "the life cycle of a butterfly", "an argument between two neighbours",
        "how the internet works", "a child's first visit to the sea", "the importance of sleep",
        "a festival in a small town", "how glass is made", "an old clock repairer", "climate and the seasons",
        "a hiking trip that goes wrong", "the story of a lost key",
    ],
    "new_tokens": 256, "temperature": 0.8, "top_p": 0.95, "seed": 0, "batch_size": 48, "quantize_batch_size": 4,
}

QUANTIZE = r'''
import json, os, sys, time
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
import torch
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
import gptqmodel
from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
from gptqmodel.quantization.config import AWQConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

src, jobs, calib = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

t0 = time.time()
tok = AutoTokenizer.from_pretrained(src)
lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
torch.manual_seed(calib["seed"])
prompts = [
    tok.apply_chat_template([{"role": "user", "content": f"Write a few paragraphs about {t}."}],
                            tokenize=False, add_generation_prompt=True)
    for t in calib["topics"]
]
texts = []
for i in range(0, len(prompts), calib["batch_size"]):
    enc = tok(prompts[i : i + calib["batch_size"]], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = lm.generate(**enc, max_new_tokens=calib["new_tokens"], do_sample=True, temperature=calib["temperature"],
                          top_p=calib["top_p"], pad_token_id=tok.pad_token_id)
    texts += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
del lm
print("CALIBRATION", len(texts), round(time.time() - t0, 1), flush=True)

# Two changes of speed, not of results, for AWQ on a CPU (both about 20 minutes each
# on 2 cores otherwise), made for the GPTQModel version they were checked against:
# - fp16 linear layers compute in fp32 and round once: what a fp16 GEMM with fp32
#   accumulation computes (equal but for the last bit in 0.2 % of outputs), without
#   the CPU's slow fp16 GEMM;
# - AWQ's clipping search forms (input_feat * w).sum(-1), a [out, tokens, groups,
#   group_size] product, for each of its 10 clip ratios; here the same sums are one
#   batched matmul over the groups.
if gptqmodel.__version__ == "7.6.0":
    from gptqmodel.looper.awq_processor import AWQProcessor

    linear_forward = torch.nn.Linear.forward

    def forward(self, x):
        if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return linear_forward(self, x)

    torch.nn.Linear.forward = forward

    @torch.inference_mode()
    def compute_best_clip(self, w, input_feat, n_grid=20, max_shrink=0.5, n_sample_token=512):
        # AWQProcessor._compute_best_clip of 7.6.0, line for line, but for product().
        assert w.dim() == 2
        org_w_shape = w.shape
        group_size = self.qcfg.group_size if self.qcfg.group_size > 0 else org_w_shape[1]
        input_feat = input_feat.view(-1, input_feat.shape[-1])
        input_feat = input_feat.reshape(1, input_feat.shape[0], -1, group_size)
        step_size = max(1, input_feat.shape[1] // n_sample_token)
        input_feat = input_feat[:, ::step_size]
        w = w.reshape(org_w_shape[0], 1, -1, group_size)
        oc_batch_size = 256 if org_w_shape[0] % 256 == 0 else 64
        assert org_w_shape[0] % oc_batch_size == 0
        w_all = w
        best_max_val_all = []
        scratch_clamp = torch.empty_like(w_all[:oc_batch_size])
        scratch_quant = torch.empty_like(scratch_clamp)
        x_t = input_feat[0].to(w_all.device).permute(1, 2, 0).float()  # [groups, group_size, tokens]

        def product(wb):  # (input_feat * wb).sum(dim=-1): [out, tokens, groups]
            return torch.bmm(wb[:, 0].permute(1, 0, 2).float(), x_t).permute(1, 2, 0).to(wb.dtype)

        for i_b in range(org_w_shape[0] // oc_batch_size):
            w = w_all[i_b * oc_batch_size : (i_b + 1) * oc_batch_size]
            org_max_val = w.abs().amax(dim=-1, keepdim=True)
            best_max_val = org_max_val.clone()
            min_errs = torch.ones_like(org_max_val) * 1e9
            clamp_slice = scratch_clamp[: w.shape[0]]
            quant_slice = scratch_quant[: w.shape[0]]
            org_out = product(w)
            for i_s in range(int(max_shrink * n_grid)):
                max_val = org_max_val * (1 - i_s / n_grid)
                torch.clamp(w, -max_val, max_val, out=clamp_slice)
                self._pseudo_quantize_tensor_into(clamp_slice, quant_slice)
                cur_out = product(quant_slice)
                err = (cur_out - org_out).pow(2).mean(dim=1).view(min_errs.shape)
                cur_best_idx = err < min_errs
                min_errs[cur_best_idx] = err[cur_best_idx]
                best_max_val[cur_best_idx] = max_val[cur_best_idx]
            best_max_val_all.append(best_max_val)
        return torch.cat(best_max_val_all, dim=0).squeeze(1)

    AWQProcessor._compute_best_clip = compute_best_clip

for dst, recipe in jobs:
    recipe = dict(recipe)
    kind, dtype, num_texts = recipe.pop("kind"), getattr(torch, recipe.pop("dtype")), recipe.pop("num_texts")
    t0 = time.time()
    if kind == "gptq":
        cfg = QuantizeConfig(act_group_aware=False, offload_to_disk=False, **recipe)
        backend = BACKEND.AUTO
    else:
        cfg = AWQConfig(offload_to_disk=False, **recipe)
        backend = BACKEND.AWQ_TORCH
    model = GPTQModel.load(src, cfg, device="cpu", dtype=dtype)
    model.quantize(texts[:num_texts], batch_size=calib["quantize_batch_size"], backend=backend)
    model.save(dst)
    with open(os.path.join(dst, "calibration.json"), "w") as f:
        json.dump(texts[:num_texts], f)
    print("QUANTIZED", kind, round(time.time() - t0, 1), flush=True)
print("OK")
'''


def tool_version(exe: str) -> str:
    res = subprocess.run(
        [exe, "-c", "import importlib.metadata as m; print(m.version('gptqmodel'))"], capture_output=True, text=True
    )
    return res.stdout.strip()


@pytest.fixture(scope="session")
def quantized(smollm2_path) -> dict[str, Path]:
    """{"gptq": dir, "awq": dir}: made by GPTQModel on the first run, reused after."""
    exe = require_tool_python()
    version = tool_version(exe)
    root = cache_root() / "quant"
    paths, jobs = {}, []
    for name, recipe in RECIPES.items():
        spec = json.dumps([recipe, CALIBRATION, QUANTIZE, version], sort_keys=True)
        key = hashlib.sha256(spec.encode()).hexdigest()[:10]
        path = root / f"SmolLM2-135M-Instruct-{name}-gptqmodel{version}-{key}"
        paths[name] = path
        if not (path / ".complete").exists():
            jobs.append((name, path, recipe))
    if jobs:
        root.mkdir(parents=True, exist_ok=True)
        staging = {name: root / f".{path.name}.{os.getpid()}" for name, path, _ in jobs}
        env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "OMP_NUM_THREADS": "2"}
        args = json.dumps([[str(staging[name]), recipe] for name, _, recipe in jobs])
        t0 = time.perf_counter()
        res = subprocess.run(
            [exe, "-c", QUANTIZE, str(smollm2_path), args, json.dumps(CALIBRATION)],
            capture_output=True, text=True, timeout=3600, env=env,
        )
        assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-4000:]
        steps = [line for line in res.stdout.splitlines() if line.startswith(("CALIBRATION", "QUANTIZED"))]
        print(f"\nquantized {[j[0] for j in jobs]} with gptqmodel {version} in {time.perf_counter() - t0:.0f} s: {steps}")
        for name, path, _ in jobs:
            (staging[name] / ".complete").write_text(version)
            try:
                os.replace(staging[name], path)
            except OSError:  # another run finished it first
                shutil.rmtree(staging[name], ignore_errors=True)
    return paths


def test_checkpoints_use_the_formats_features(quantized):
    from safetensors import safe_open

    gptq = ModelConfig.from_dir(quantized["gptq"]).quantization
    assert gptq["quant_method"] == "gptq" and gptq["desc_act"] and not gptq["sym"] and gptq["group_size"] == 32
    assert gptq.get("checkpoint_format", "gptq") == "gptq"  # v1: stored zeros are zero - 1
    awq = ModelConfig.from_dir(quantized["awq"]).quantization
    assert awq["quant_method"] == "awq" and awq.get("zero_point", True)
    with safe_open(str(quantized["gptq"] / "model.safetensors"), "pt") as f:
        g_idx = f.get_tensor("model.layers.3.mlp.down_proj.g_idx")
        assert not torch.equal(g_idx, (torch.arange(g_idx.numel()) // 32).to(g_idx.dtype))  # act order
        assert "lm_head.qweight" not in f.keys()


@pytest.fixture(scope="session")
def tool_weights(quantized, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("smollm2-tool-dequant")
    run_tool_dequant([(quantized[name], out / f"{name}.safetensors") for name in quantized])
    return {name: load_file(str(out / f"{name}.safetensors")) for name in quantized}


def load(path: Path, kernel: str = "dense") -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    factory = linear_method_factory(cfg, kernel) if cfg.quantization is not None else (lambda prefix: None)
    model = LlamaForCausalLM(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), factory, max_position=2048)
    load_weights(model, path)
    return model


@pytest.mark.parametrize("name", list(RECIPES))
def test_weights_equal_the_tools_dequantization(quantized, tool_weights, name):
    ours = loaded_weights(load(quantized[name]))
    theirs = tool_weights[name]
    assert len(theirs) == 30 * 7
    for module, w in theirs.items():
        assert torch.equal(ours[module].to(w.dtype), w), module


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, token_ids: list[int]) -> float:
    """exp(mean NLL) of each token given the ones before it, in one prefill."""
    cfg = model.cfg
    n, block = len(token_ids), 16
    num_blocks = -(-n // block)
    for layer in model.layers:
        shape = (num_blocks, block, cfg.num_kv_heads, cfg.head_dim)  # [num_blocks, block_size, kv_heads, head_dim]
        layer.self_attn.k_cache, layer.self_attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = model(torch.tensor(token_ids), torch.arange(n), meta)
    logits = model.compute_logits(hidden[:-1])  # [n - 1, vocab] fp32
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:])).exp())


def test_perplexity_within_ten_percent_of_fp16(smollm2_path, quantized):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_path))(PASSAGE)["input_ids"]
    ppl = {"fp16": perplexity(load(smollm2_path), ids)}
    for name, path in quantized.items():
        ppl[name] = perplexity(load(path), ids)
    figures = ", ".join(f"{k} {v:.2f} ({v / ppl['fp16']:.3f})" for k, v in ppl.items())
    print(f"\nperplexity over {len(ids)} tokens (ratio to fp16): {figures}")
    for name in quantized:
        assert ppl[name] <= 1.10 * ppl["fp16"], (name, ppl)


# Chat prompts, as the model is an instruct model: to the bare completion prompt "The
# capital of France is" even the fp16 model answers " Paris." and then a date, mostly
# digits. The fp16 model runs the same checks, so each check is one the reference passes.
PROMPTS = [
    ([{"role": "user", "content": "What is the capital of France?"}], ["paris"]),
    ([{"role": "user", "content": "What is the boiling point of water at sea level, in Celsius?"}], ["boil", "water"]),
]


@pytest.mark.parametrize("name", ["fp16", *RECIPES])
def test_generates_coherent_text(request, name):
    path = request.getfixturevalue("smollm2_path" if name == "fp16" else "quantized")
    path = path if name == "fp16" else path[name]

    async def main():
        async with AsyncEngine.from_pretrained(path, max_num_seqs=8, max_model_len=512) as engine:
            params = SamplingParams(max_tokens=32, temperature=0)
            return [(await engine.generate(messages=prompt, params=params)).text for prompt, _ in PROMPTS]

    texts = anyio.run(main)
    print(f"\n{name}: {texts}")
    for text, (_, words) in zip(texts, PROMPTS):
        assert all(w in text.lower() for w in words), text
        assert "\ufffd" not in text and sum(c.isalpha() for c in text) > len(text) // 2, text
