"""Hugging Face Llama (``LlamaForCausalLM``) <-> megatron-core ``GPTModel``: config and weights.

No converter from PyPI works here: ``mbridge`` 0.15.1 builds its Llama with the TransformerEngine
layer spec (TE is not installable on this CPU machine), names the norms by TE's fused
``linear_qkv.layer_norm_weight`` and reads ``config.rope_theta``, which transformers 5 moved into
``rope_parameters``; Megatron-LM's ``tools/checkpoint`` is not in the megatron-core wheel. So this
is a small mapping for megatron-core's *local* layer spec (pure PyTorch; RMSNorm, SwiGLU, RoPE,
GQA, no biases, tied or untied embeddings), pipeline size 1.

Layouts (``H`` hidden, ``d`` head dim, ``G`` KV groups, ``q = heads / G`` query heads per group,
``F`` ffn size, ``V`` vocab); "full" = the whole (unsharded) Megatron param, as in Megatron's
checkpoints, named by Megatron's checkpoint keys with the layer number put back (= Fair Cast's
canonical names; the local spec saves its norms under TE's fused names, so these differ from
``named_parameters()`` for the two per-layer norms; :func:`megatron_patches.gather.gather_full`
gathers a TP-split model into exactly these):

* ``decoder.layers.L.self_attention.linear_qkv.weight`` ``[G' (q + 2) d, H]``: per query group
  ``g``, the ``q`` query heads of ``g`` (HF ``q_proj`` rows ``g q d .. (g+1) q d``), then its key
  head, then its value head. TP splits it on dim 0 (whole groups per rank).
* ``...linear_proj.weight`` ``[H, G' q d]`` = ``o_proj``; TP splits dim 1.
* ``...mlp.linear_fc1.weight`` ``[2F, H]`` = ``[gate_proj; up_proj]``; TP rank ``r`` holds
  ``[gate_r; up_r]`` (each half split on dim 0). ``...linear_fc2.weight`` = ``down_proj``, dim 1.
* ``...self_attention.linear_qkv.layer_norm_weight`` (param ``input_layernorm.weight``) =
  ``input_layernorm``; ``...mlp.linear_fc1.layer_norm_weight`` (param
  ``pre_mlp_layernorm.weight``) = ``post_attention_layernorm``; ``decoder.final_layernorm.weight``
  = ``model.norm``; replicated.
* ``embedding.word_embeddings.weight`` ``[V, H]`` = ``embed_tokens``, dim 0; with untied
  embeddings ``output_layer.weight`` = ``lm_head``, dim 0.

**KV-group padding.** Megatron needs heads and KV groups divisible by the TP size. SmolLM2-135M
has 9 heads in 3 groups, so at TP=2 the model gets ``G' = 4`` groups (12 heads): the extra group's
query/key/value rows and its ``linear_proj`` columns are zero. Its heads then output exactly 0
(zero values), and every gradient reaching those weights is exactly 0, so with zero weight decay
they stay 0 and the model computes and trains as the 3-group one. :func:`padding_masks` marks the
real elements (telemetry counts only those); :func:`megatron_to_hf` drops the padding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["check_hf_config", "rope_theta", "padded_groups", "transformer_config", "build_gpt",
           "hf_to_megatron", "megatron_to_hf", "checkpoint_name", "padding_masks", "tp_shard", "load_hf_state"]


# ----------------------------------------------------------------------------- config
def rope_theta(hf_config) -> float:
    """RoPE base of a HF Llama config (transformers 5 ``rope_parameters``, or 4.x ``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf_config.rope_theta)


def check_hf_config(hf_config) -> None:
    """Refuse Llama features this mapping does not carry.

    Raises:
        ValueError: naming the field and value (model_type, hidden_act, attention_bias,
            mlp_bias, a non-default RoPE type / scaling, heads not a multiple of KV groups).
    """
    checks = [("model_type", getattr(hf_config, "model_type", None), lambda v: v == "llama", "'llama'"),
              ("hidden_act", getattr(hf_config, "hidden_act", None), lambda v: v == "silu", "'silu'"),
              ("attention_bias", getattr(hf_config, "attention_bias", False), lambda v: not v, "False"),
              ("mlp_bias", getattr(hf_config, "mlp_bias", False), lambda v: not v, "False")]
    params = getattr(hf_config, "rope_parameters", None) or {}
    checks.append(("rope_parameters['rope_type']", params.get("rope_type", "default"),
                   lambda v: v == "default", "'default' (no RoPE scaling)"))
    for field, value, ok, want in checks:
        if not ok(value):
            raise ValueError(f"HF config {field}={value!r} is not supported by the Megatron mapping (needs {want})")
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")


def head_dim(hf_config) -> int:
    """Per-head size ``d`` (HF ``head_dim``, else hidden_size / num_attention_heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def padded_groups(groups: int, tp: int) -> int:
    """KV groups after padding to a multiple of the TP size (see the module docstring)."""
    if groups <= 0 or tp <= 0:
        raise ValueError(f"padded_groups needs groups > 0 and tp > 0, got groups={groups}, tp={tp}")
    return math.ceil(groups / tp) * tp


def transformer_config(hf_config, tp: int, dtype: torch.dtype = torch.bfloat16, **overrides):
    """The megatron-core ``TransformerConfig`` of a HF Llama config at TP size ``tp``.

    Args:
        hf_config: a ``LlamaConfig`` (checked by :func:`check_hf_config`).
        tp: tensor-parallel size (KV groups are padded to a multiple of it).
        dtype: ``torch.bfloat16`` (bf16 params, as trained) or ``torch.float32``.
        overrides: further ``TransformerConfig`` fields.
    """
    from megatron.core.transformer import TransformerConfig
    check_hf_config(hf_config)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    groups = padded_groups(hf_config.num_key_value_heads, tp)
    per_group = hf_config.num_attention_heads // hf_config.num_key_value_heads
    fields = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=groups * per_group, num_query_groups=groups, kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=False,  # every weight is loaded
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, sequence_parallel=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt(hf_config, tp: int, dtype: torch.dtype = torch.bfloat16, **overrides):
    """A megatron-core ``GPTModel`` (local spec) shaped like the HF Llama, weights unset.

    Needs ``parallel_state`` initialized with TP size ``tp`` and pipeline size 1.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError(f"the Llama mapping supports pipeline size 1, not "
                         f"{ps.get_pipeline_model_parallel_world_size()}")
    if ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"tp={tp} but parallel_state has TP size {ps.get_tensor_model_parallel_world_size()}")
    if hf_config.vocab_size % tp:
        raise ValueError(f"vocab_size={hf_config.vocab_size} is not divisible by the TP size {tp}")
    config = transformer_config(hf_config, tp, dtype, **overrides)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
                    position_embedding_type="rope", rotary_percent=1.0, rotary_base=rope_theta(hf_config))


# ----------------------------------------------------------------------------- weights
_LAYER = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
          "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
# local-spec param name -> checkpoint key (megatron-core's local spec keeps TE's names in checkpoints)
_PARAM_TO_CKPT = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def hf_to_megatron(hf_state: dict, hf_config, tp: int = 1) -> dict:
    """Full Megatron tensors ``{name: tensor}`` from a HF Llama state dict (dtypes kept).

    Args:
        hf_state: ``LlamaForCausalLM.state_dict()``-style ``{name: tensor}`` (``lm_head.weight``
            ignored when tied).
        hf_config: its ``LlamaConfig``.
        tp: the TP size the KV groups are padded for.

    Raises:
        KeyError: a HF weight missing (named). ValueError: a weight of the wrong shape (named).
    """
    check_hf_config(hf_config)
    H, d, G = hf_config.hidden_size, head_dim(hf_config), hf_config.num_key_value_heads
    q, Gp, F = hf_config.num_attention_heads // G, padded_groups(G, tp), hf_config.intermediate_size

    def get(name, shape):
        if name not in hf_state:
            raise KeyError(f"HF state dict has no {name!r}")
        t = hf_state[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"HF weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight", (hf_config.vocab_size, H))}
    for i in range(hf_config.num_hidden_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        wq = get(hf + "self_attn.q_proj.weight", (G * q * d, H)).reshape(G, q * d, H)
        wk = get(hf + "self_attn.k_proj.weight", (G * d, H)).reshape(G, d, H)
        wv = get(hf + "self_attn.v_proj.weight", (G * d, H)).reshape(G, d, H)
        qkv = torch.cat([wq, wk, wv], dim=1)  # [G, (q + 2) d, H]
        qkv = torch.cat([qkv, qkv.new_zeros(Gp - G, (q + 2) * d, H)])  # zero padding groups
        out[mc + "self_attention.linear_qkv.weight"] = qkv.reshape(Gp * (q + 2) * d, H)
        wo = get(hf + "self_attn.o_proj.weight", (H, G * q * d))
        out[mc + "self_attention.linear_proj.weight"] = torch.cat([wo, wo.new_zeros(H, (Gp - G) * q * d)], dim=1)
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([get(hf + "mlp.gate_proj.weight", (F, H)),
                                                       get(hf + "mlp.up_proj.weight", (F, H))])
        out[mc + "mlp.linear_fc2.weight"] = get(hf + _LAYER["mlp.linear_fc2.weight"], (H, F))
        for key in ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"):
            out[mc + key] = get(hf + _LAYER[key], (H,))
    out["decoder.final_layernorm.weight"] = get("model.norm.weight", (H,))
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = get("lm_head.weight", (hf_config.vocab_size, H))
    return out


def megatron_to_hf(mc_state: dict, hf_config) -> dict:
    """The inverse of :func:`hf_to_megatron`: HF names, padding dropped (views where possible).

    The padding is read off the ``linear_qkv`` shape, so any TP size's full tensors work. With
    tied embeddings only ``model.embed_tokens.weight`` is returned (``lm_head`` shares it).

    FP8 served weights (``megatron_patches.served_weights`` with ``--export-cast-format fp8``) map too: an
    E4M3 weight as the bf16 one, and its scales beside it under the HF name (``...weight_scale`` rows split
    with the weight's; ``...weight_scale_inv``, the 128x128 blocks of the q/k/v and gate/up tensors one after
    the other, split at each tensor's block rows, the padding groups' blocks dropped).
    """
    H, d, G = hf_config.hidden_size, head_dim(hf_config), hf_config.num_key_value_heads
    q = hf_config.num_attention_heads // G
    F = hf_config.intermediate_size
    blocks = lambda n: -(-n // 128)  # noqa: E731
    out = {f"model.embed_tokens.{key}": t for key, t in _with_scales(mc_state, "embedding.word_embeddings.")}
    for i in range(hf_config.num_hidden_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = mc_state[mc + "self_attention.linear_qkv.weight"]
        if qkv.shape[0] % ((q + 2) * d) or qkv.shape[0] // ((q + 2) * d) < G:
            raise ValueError(f"{mc}self_attention.linear_qkv.weight has shape {tuple(qkv.shape)}: not "
                             f"a multiple >= {G} of {(q + 2) * d} rows (q={q} heads + k + v, head dim {d})")
        Gp = qkv.shape[0] // ((q + 2) * d)
        for key, t in _with_scales(mc_state, mc + "self_attention.linear_qkv."):
            if key == "weight_scale_inv":  # [q blocks; k blocks; v blocks] of the padded tensors
                sq, sk, sv = t.split([blocks(Gp * q * d), blocks(Gp * d), blocks(Gp * d)])
                parts = sq[:blocks(G * q * d)], sk[:blocks(G * d)], sv[:blocks(G * d)]
            else:
                x = t.reshape(Gp, (q + 2) * d, t.shape[1])[:G]
                parts = [x[:, a:b].reshape(-1, t.shape[1]) for a, b in ((0, q * d), (q * d, (q + 1) * d),
                                                                         ((q + 1) * d, (q + 2) * d))]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{hf}self_attn.{proj}.{key}"] = part
        for key, t in _with_scales(mc_state, mc + "self_attention.linear_proj."):
            out[f"{hf}self_attn.o_proj.{key}"] = t[:, :blocks(G * q * d)] if key == "weight_scale_inv" \
                else t[:, :G * q * d] if key == "weight" else t
        for key, t in _with_scales(mc_state, mc + "mlp.linear_fc1."):
            cut = blocks(F) if key == "weight_scale_inv" else F
            out[f"{hf}mlp.gate_proj.{key}"], out[f"{hf}mlp.up_proj.{key}"] = t[:cut], t[cut:]
        for mc_name, hf_name in _LAYER.items():
            for key, t in _with_scales(mc_state, mc + mc_name[:-len("weight")]):
                out[hf + hf_name[:-len("weight")] + key] = t
    out["model.norm.weight"] = mc_state["decoder.final_layernorm.weight"]
    if not hf_config.tie_word_embeddings:
        out.update({f"lm_head.{key}": t for key, t in _with_scales(mc_state, "output_layer.")})
    return out


def _with_scales(mc_state: dict, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of ``prefix + "weight"`` and, for an FP8 weight, its ``weight_scale`` / ``weight_scale_inv``
    (a norm's ``layer_norm_weight`` prefix ends in ``layer_norm_``)."""
    return [(key, mc_state[prefix + key]) for key in ("weight", "weight_scale", "weight_scale_inv")
            if prefix + key in mc_state]


def padding_masks(hf_config, tp: int) -> dict:
    """``{name: bool tensor}`` True on the real (not padding) elements of the full Megatron
    params that have KV-group padding at TP size ``tp``; empty when there is none."""
    H, d, G = hf_config.hidden_size, head_dim(hf_config), hf_config.num_key_value_heads
    q, Gp = hf_config.num_attention_heads // G, padded_groups(G, tp)
    if Gp == G:
        return {}
    qkv = torch.zeros(Gp, (q + 2) * d, H, dtype=torch.bool)
    qkv[:G] = True
    proj = torch.zeros(H, Gp * q * d, dtype=torch.bool)
    proj[:, :G * q * d] = True
    masks = {}
    for i in range(hf_config.num_hidden_layers):
        masks[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = qkv.reshape(-1, H)
        masks[f"decoder.layers.{i}.self_attention.linear_proj.weight"] = proj
    return masks


def checkpoint_name(param_name: str) -> str:
    """The full-tensor name (checkpoint key with its layer) of a ``GPTModel`` param name."""
    for param_key, ckpt_key in _PARAM_TO_CKPT.items():
        if param_name.endswith("." + param_key) and ".layers." in param_name:
            return param_name[:-len(param_key)] + ckpt_key
    return param_name


def _tp_dim(name: str) -> Optional[int]:
    if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None  # norms: replicated


def tp_shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s part of the full Megatron param ``name`` (a view or the whole tensor).

    Raises:
        ValueError: the split dimension is not divisible by ``tp`` (names the param).
    """
    dim = _tp_dim(name)
    if dim is None or tp == 1:
        return full
    if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate_r; up_r]
        gate, up = full.chunk(2)
        if gate.shape[0] % tp:
            raise ValueError(f"{name}: ffn size {gate.shape[0]} is not divisible by the TP size {tp}")
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of {tuple(full.shape)} is not divisible by the TP size {tp}")
    return full.chunk(tp, dim=dim)[rank]


@torch.no_grad()
def load_hf_state(model, hf_state: dict, hf_config) -> None:
    """Copy a HF Llama state dict into this rank's TP part of ``model`` (every param).

    Args:
        model: the ``GPTModel`` from :func:`build_gpt` (unwrapped; before Float16Module/DDP).
        hf_state, hf_config: the HF weights (fp32 are rounded to the param dtype by ``copy_``).

    Raises:
        ValueError: a param with no HF weight, or a shard shape / TP split dim that does not
            match the param's own (names the param).
    """
    from megatron.core import parallel_state as ps
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full = hf_to_megatron(hf_state, hf_config, tp)
    seen = set()
    for param_name, param in model.named_parameters():
        name = checkpoint_name(param_name)
        if name not in full:
            raise ValueError(f"Megatron param {param_name!r} ({name!r}) has no HF weight in the Llama mapping")
        dim = _tp_dim(name)
        if getattr(param, "tensor_model_parallel", False) and tp > 1 and param.partition_dim != dim:
            raise ValueError(f"{name}: Megatron splits dim {param.partition_dim}, the mapping dim {dim}")
        shard = tp_shard(name, full[name], tp, rank)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: TP shard {tuple(shard.shape)} != param {tuple(param.shape)}")
        param.copy_(shard)
        seen.add(name)
    unused = sorted(set(full) - seen)
    if unused:
        raise ValueError(f"mapped weights with no Megatron param: {unused}")
