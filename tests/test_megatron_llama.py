"""The HF Llama -> megatron-core GPTModel mapping of the Megatron main job (scripts/megatron_llama.py).

Multi-process cases: the Megatron model built from the HF weights gives the HF logits (fp32: to
float rounding; bf16 params: within bf16 tolerance) at TP=1 and TP=2, its weights gathered with
Megatron's own checkpoint metadata equal the mapping, and the KV-group padding gets zero gradient.
The real SmolLM2 check is by hand: ``python tests/megatron_llama_worker.py --model smollm2``.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import megatron_llama as ml  # noqa: E402
from megatron_llama_worker import run  # noqa: E402

GQA3 = dict(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3)  # as SmolLM2: 3 groups
BF16_EPS = 2.0 ** -8


def tiny_config(**overrides):
    from transformers import LlamaConfig
    from fair_demo_common import TINY_LLAMA
    return LlamaConfig(**{**TINY_LLAMA, **GQA3, **overrides})


def random_hf_state(cfg, seed=0):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return {k: v.detach() for k, v in LlamaForCausalLM(cfg).state_dict().items()}


# -- single process ------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_full_layout_round_trips_and_pads_with_zero_groups(tp):
    cfg = tiny_config()
    hf = random_hf_state(cfg)
    full = ml.hf_to_megatron(hf, cfg, tp)
    G, Gp, q, d, H = 3, ml.padded_groups(3, tp), 2, 8, 48
    qkv = full["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == (Gp * (q + 2) * d, H)
    groups = qkv.view(Gp, (q + 2) * d, H)
    # group g = [q heads of g; k_g; v_g], HF heads g*q .. g*q+q-1 use KV head g
    assert torch.equal(groups[2, :q * d], hf["model.layers.1.self_attn.q_proj.weight"][2 * q * d:3 * q * d])
    assert torch.equal(groups[2, q * d:(q + 1) * d], hf["model.layers.1.self_attn.k_proj.weight"][2 * d:3 * d])
    assert torch.equal(groups[2, (q + 1) * d:], hf["model.layers.1.self_attn.v_proj.weight"][2 * d:3 * d])
    assert not groups[G:].any() and not full["decoder.layers.1.self_attention.linear_proj.weight"][:, G * q * d:].any()
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(full["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                       hf["model.layers.0.input_layernorm.weight"])
    back = ml.megatron_to_hf(full, cfg)
    assert sorted(back) == sorted(k for k in hf if k != "lm_head.weight")  # tied
    assert all(torch.equal(back[k], hf[k]) for k in back)
    masks = ml.padding_masks(cfg, tp)
    assert (sorted(masks) != []) == (Gp != G)
    for name, mask in masks.items():
        assert mask.shape == full[name].shape and not full[name][~mask].any()
        assert int(mask.sum()) == (G * (q + 2) * d * H if "qkv" in name else H * G * q * d)


def _fp8_export(config, masters, fused=None):
    """``{name: E4M3 weight, scale name: scales}`` of one single-process FP8 export of whole ``masters``."""
    from faircast_dist.export import ExportState, Shard
    state = ExportState(config, shapes={n: m.shape for n, m in masters.items()}, fused=fused)
    shards = [Shard(n, m.reshape(-1).float().contiguous(), torch.zeros(m.numel(), dtype=torch.bfloat16),
                    [(n, 0, m.numel(), 0)]) for n, m in masters.items()]
    state.export_fp8(shards)
    full = state.full_fp8(shards)
    return {**full, **{state.fp8.scale_name(n): s for n, s in state.fp8.scales.items()}}


@pytest.mark.parametrize("scales, tp, exclude", [("channel", 1, None), ("channel", 4, None), ("block", 1, None),
                                                 ("block", 4, None), ("channel", 1, "norm"), ("block", 1, "norm")])
def test_fp8_served_megatron_weights_map_to_the_hf_fp8_checkpoint(scales, tp, exclude):
    """FP8 round-to-nearest (the stacks' cast: no random bits keyed on names) of the Megatron layout (fused q/k/v
    and gate/up, KV groups padded at TP 4) mapped by megatron_to_hf is the FP8 checkpoint of the HF tensors, byte for
    byte and scale for scale: with block scales, the padded stack's blocks (megatron_patches.layout.fused_rows) are
    the HF tensors' (dims not multiples of 128: 2 KV groups of 2 heads of 72, ffn 200, hidden 256). With
    ``fp8_exclude "norm"`` (untied) the embedding and LM head are FP8 too, and keep their scales."""
    from megatron_patches.layout import fused_rows
    cfg = tiny_config(hidden_size=256, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=72, tie_word_embeddings=exclude is None)
    hf = {k: v.float() for k, v in random_hf_state(cfg).items()}
    config = {"mode": "nearest", "format": "fp8", "fp8_scales": scales, **({"fp8_exclude": exclude} if exclude else {})}
    if exclude:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(_fp8_export(config, hf))
    mc = ml.hf_to_megatron(hf, cfg, tp)
    tconfig = ml.transformer_config(cfg, tp)
    fused = {n: f for n, m in mc.items() if m.dim() == 2 and (f := fused_rows(n, m.shape, tconfig))}
    assert len(fused) == 2 * cfg.num_hidden_layers
    served = ml.megatron_to_hf({**mc, **_fp8_export(config, mc, fused)}, cfg)
    want = _fp8_export(config, hf)
    assert sorted(n for n in served if "_scale" in n) == sorted(n for n in want if "_scale" in n)
    for name, t in want.items():
        assert t.dtype == served[name].dtype and torch.equal(served[name].view(torch.uint8) if t.dtype ==
                                                              torch.float8_e4m3fn else served[name],
                                                              t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                                              else t), name
    if scales == "block":
        assert want["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (3, 2)


def test_tp_shards_put_whole_groups_and_gate_up_halves_on_each_rank():
    cfg = tiny_config()
    full = ml.hf_to_megatron(random_hf_state(cfg), cfg, 2)
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate 96; up 96]
    r1 = ml.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 2, 1)
    assert torch.equal(r1, torch.cat([fc1[48:96], fc1[144:]]))
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]  # 4 groups x 32 rows
    assert torch.equal(ml.tp_shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 2, 1), qkv[64:])
    proj = full["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(ml.tp_shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 2, 0), proj[:, :32])
    norm = full["decoder.final_layernorm.weight"]
    assert ml.tp_shard("decoder.final_layernorm.weight", norm, 2, 1) is norm
    with pytest.raises(ValueError, match="linear_fc2.weight: dim 1 of .* not divisible by the TP size 5"):
        ml.tp_shard("decoder.layers.0.mlp.linear_fc2.weight", full["decoder.layers.0.mlp.linear_fc2.weight"], 5, 0)
    assert ml.checkpoint_name("decoder.layers.7.pre_mlp_layernorm.weight") == "decoder.layers.7.mlp.linear_fc1.layer_norm_weight"


@pytest.mark.parametrize("field, value, message", [
    ("attention_bias", True, "attention_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_type'\\]='linear'"),
])
def test_unsupported_llama_features_are_refused_by_name(field, value, message):
    cfg = tiny_config()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=message):
        ml.check_hf_config(cfg)


def test_missing_or_misshapen_hf_weights_are_named():
    cfg = tiny_config()
    hf = random_hf_state(cfg)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        ml.hf_to_megatron(hf, cfg)
    hf = random_hf_state(cfg)
    hf["model.norm.weight"] = torch.ones(47)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(47,\), expected \(48,\)"):
        ml.hf_to_megatron(hf, cfg)
    assert ml.rope_theta(tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 1e5})) == 1e5


# -- real ranks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, dtype, overrides", [
    (1, "fp32", GQA3),
    (2, "fp32", GQA3),  # 3 KV groups padded to 4
    (2, "bf16", GQA3),  # as trained: bf16 params
    (2, "fp32", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),  # no padding, lm_head
], ids=["tp1-fp32", "tp2-fp32-padded", "tp2-bf16-padded", "tp2-fp32-untied"])
def test_megatron_model_from_hf_weights_gives_hf_logits(tp, dtype, overrides):
    r = run(tp, "tiny", dtype, tiny=overrides)
    hf, mc = r["hf_logits"], r["mc_logits"]
    assert mc.shape == hf.shape
    scale = max(1.0, float(hf.abs().max()))
    diff = float((mc - hf).abs().max())
    if dtype == "fp32":  # the mapping is exact: float rounding only
        tol = 1e-5 * scale
    else:  # bf16 tolerance: no worse than twice the HF model's own bf16 error (plus one bf16 ulp)
        tol = 2 * float((r["hf_bf16_logits"] - hf).abs().max()) + BF16_EPS * scale
    assert diff <= tol, f"max |logit diff| {diff} > {tol}"
    assert r["full_names"] and r["full_mismatch"] == 0  # tp_shard == Megatron's checkpoint layout
    assert r["back_names"] and r["back_mismatch"] == 0
    assert r["real_grad_nonzero"]
    if tp == 2 and overrides.get("num_key_value_heads") == 3:
        assert r["pad_weight_max"] == 0.0 and r["pad_grad_max"] == 0.0
    else:
        assert r["pad_grad_max"] is None
