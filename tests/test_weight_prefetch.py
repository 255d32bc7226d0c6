"""L2 weight prefetch (asyncgen.model.prefetch): where the forward pass asks for each
weight, how much of it, and that asking changes nothing it computes. The prefetch kernel
itself runs on the H200 (tests/gpu/check_csrc_ops.py) and its chunking in the emulator
(tests/test_csrc_emulated.py)."""

from __future__ import annotations

import pytest
import torch

from asyncgen._ops import get_ops
from asyncgen.model.config import ModelConfig
from asyncgen.model.llama import AttentionMetadata, LlamaForCausalLM
from asyncgen.model.loader import load_weights
from asyncgen.model.prefetch import WeightPrefetch


class Recorder:
    """Stands in for the backend's prefetch_l2: records (tensor, bytes) per call."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, int]] = []

    def __call__(self, t: torch.Tensor, max_bytes: int) -> None:
        self.calls.append((t, max_bytes))


@pytest.fixture(scope="module")
def model(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    m = LlamaForCausalLM(cfg, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(m, tiny_llama)
    return m


def _decode_step(model, prefetch=None, batch=3, context=9):
    """One decode step of ``batch`` sequences over random cached context."""
    cfg, block_size = model.cfg, 4
    torch.manual_seed(1)
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = batch * blocks_per_seq + 2
    for layer in model.layers:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        layer.self_attn.k_cache = torch.randn(shape)
        layer.self_attn.v_cache = torch.randn(shape)
    tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    pos = torch.full((batch,), context)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    meta = AttentionMetadata(
        slots, tables, torch.full((batch,), context + 1, dtype=torch.int32),
        torch.arange(batch + 1, dtype=torch.int32), 1, context + 1,
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, meta, prefetch))


def test_each_weight_is_asked_for_where_the_kernels_before_it_begin(model):
    rec = Recorder()
    _decode_step(model, WeightPrefetch(rec, max_bytes=1 << 30))
    expected = []
    for layer in model.layers:
        expected += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                     layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    assert [t.data_ptr() for t, _ in rec.calls] == [t.data_ptr() for t in expected]
    # Under the budget, the whole of each weight.
    assert [n for _, n in rec.calls] == [t.numel() * t.element_size() for t in expected]


def test_a_budget_takes_the_start_of_each_weight_and_targets_filter(model):
    rec = Recorder()
    budget = 1000
    _decode_step(model, WeightPrefetch(rec, max_bytes=budget, targets={"o_proj", "down_proj"}))
    expected = [w for layer in model.layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    assert [t.data_ptr() for t, _ in rec.calls] == [t.data_ptr() for t in expected]
    assert all(n == budget for _, n in rec.calls)  # every weight here is larger than the budget
    assert all(t.numel() * t.element_size() > budget for t in expected)


def test_prefetching_changes_no_output(model):
    plain = _decode_step(model)
    assert plain.abs().max() > 0.1
    with_prefetch = _decode_step(model, WeightPrefetch(Recorder(), max_bytes=1 << 20))
    assert torch.equal(plain, with_prefetch)


def test_quantized_layers_name_their_packed_tensors():
    from asyncgen.model.linear import QKVLinear
    from asyncgen.model.quantization import QuantConfig, QuantLinearMethod

    scheme = QuantConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                    "version": "gemm"}).scheme_for("model.layers.0.self_attn.qkv_proj")
    layer = QKVLinear("model.layers.0.self_attn", 64, 2, 2, 16, False, torch.float16, "cpu",
                      QuantLinearMethod(scheme, kernel="triton"))
    layer.qweight, layer.scales, layer.zeros = torch.zeros(8, 64, dtype=torch.int32), torch.ones(2, 64), torch.ones(2, 64)
    rec = Recorder()
    WeightPrefetch(rec, max_bytes=1024).ahead(layer)
    total = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.zeros))
    assert [t is u for (t, _), u in zip(rec.calls, (layer.qweight, layer.scales, layer.zeros))] == [True] * 3
    # The same share of each tensor, so the codes and their scales arrive together.
    assert [n for _, n in rec.calls] == [int(t.numel() * t.element_size() * 1024 / total)
                                         for t in (layer.qweight, layer.scales, layer.zeros)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        WeightPrefetch(Recorder(), max_bytes=-1)
    with pytest.raises(ValueError, match="lm_head"):
        WeightPrefetch(Recorder(), max_bytes=1, targets={"lm_head"})
