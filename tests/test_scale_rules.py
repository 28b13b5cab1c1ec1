"""The stacks' FP8 quantizers as scale rules (faircast_dist.fp8.PRESETS): under ``mode "nearest"`` a preset serves,
byte for byte, what the stack's own function serves from the same bf16 weights (verl's installed
``_scaled_fp8_blockwise_pytorch``, vLLM's online per-channel functions and ``per_block_cast_to_fp8``, cited copies
where nothing runs here), through the whole export (fused kernel, absmax, scales, multipliers); the fair methods
take the same rule and serve codes that the stack's quantizer, given ``bf16(q * s)``, returns unchanged."""
import importlib.util
import itertools
import os

import pytest
import torch

from faircast_dist import ConfigError, ExportCastConfig
from faircast_dist.export import ExportState, Shard
from faircast_dist.fp8 import PRESETS, ScaleRule
from helpers import bits

# params of a tiny HF Llama layer: q/k/v and gate/up fused by vLLM; rows cut by the 128 blocks, a zero row, a
# block-wide row of tiny values (under vLLM's block amax floor) and a channel under its scale floor
SHAPES = {"model.layers.0.self_attn.q_proj.weight": (256, 200), "model.layers.0.self_attn.k_proj.weight": (128, 200),
          "model.layers.0.self_attn.v_proj.weight": (72, 200), "model.layers.0.mlp.down_proj.weight": (200, 300)}


# elements on E4M3 midpoints (1 + (2j + 1) / 16) * 2**e, signs alternating, times 7 / 64: the scale of a group
# whose maximum is 49 (all exact in bf16), so x / s is an exact tie that x * (1 / s) misses for 14 of them
TIES = torch.tensor([(1 + (2 * j + 1) / 16) * 2.0 ** e * (-1) ** j * 7 / 64 for e in range(-3, 4) for j in range(8)])


def masters_of(seed: int = 0, shapes=SHAPES) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        m = torch.randn(shape, generator=g) * 0.02 * (k + 1)
        m[3] = 0.0
        if shape[0] > 200:  # a whole 128x128 block of tiny values (under vLLM's block amax floor 1e-4)
            m[128:256, 128:] = torch.randn(128, shape[1] - 128, generator=g) * 1e-7
        if shape[0] > 133:  # channels under vLLM's scale floor
            m[130:133] = torch.randn(3, shape[1], generator=g) * 1e-7
        m[5, 7] = 0.3 * (k + 1)  # an outlier
        if k in (0, 3):  # q and down (then q, k and v have other maxima: a per-tensor scale of q alone differs)
            m[1, :len(TIES)], m[1, len(TIES)] = TIES, 49.0
        if shape == (200, 300):
            m[128:, 256:] = 0.0  # an all-zero block
        out[name] = m
    return out


def export(config: dict, masters: dict, steps: int = 1) -> tuple[dict, ExportState]:
    """A one-process export of ``masters`` (one shard per param) under ``config``: ``{name: E4M3, scale name:
    scales}`` as served, and the state."""
    state = ExportState(config, shapes={n: tuple(m.shape) for n, m in masters.items()})
    pieces = [Shard(n, m.reshape(-1).contiguous(), torch.empty(m.numel(), dtype=torch.bfloat16),
                    [(n, 0, m.numel(), 0)]) for n, m in masters.items()]
    for _ in range(steps):
        state.export(pieces)
    full = state.full_fp8(pieces)
    return dict(state.fp8.served(((n, None) for n in full), full)), state


def verl_quantizer():
    """verl 0.9.1's installed ``verl/utils/kernel/fp8_kernel.py`` (its PyTorch path: ``VERL_DISABLE_TRITON_FP8``),
    loaded by path: ``import verl`` itself needs ray and more, which the tests do not install."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (make test installs verl==0.9.1 --no-deps)")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "kernel", "fp8_kernel.py")
    old = os.environ.get("VERL_DISABLE_TRITON_FP8")
    os.environ["VERL_DISABLE_TRITON_FP8"] = "1"
    try:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("verl_fp8_kernel", path))
        module.__spec__.loader.exec_module(module)
    finally:
        os.environ.pop("VERL_DISABLE_TRITON_FP8") if old is None else os.environ.__setitem__("VERL_DISABLE_TRITON_FP8", old)
    return module.scaled_fp8_blockwise


def vllm_online():
    """vLLM 0.32's own online FP8 functions (per channel, per block), as the engine calls them."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    def per_channel(w):
        scale = online._fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
        return online._fp8_quant_per_channel(w, scale), scale

    return per_channel, lambda w: per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)


def verl_triton_copy(w: torch.Tensor):
    """A copy of verl 0.9.1's Triton ``_blockwise_cast_to_fp8_kernel`` (``fp8_kernel.py``), per 128x128 block of the
    zero-padded weight: ``s = max(amax, 1e-10) / 448``, codes ``clamp(x * (1 / s))``; returns ``(codes, s)``."""
    n, k = w.shape
    x = torch.nn.functional.pad(w.float(), (0, -k % 128, 0, -n % 128))
    blocks = x.view(x.shape[0] // 128, 128, x.shape[1] // 128, 128)
    s = torch.clamp(blocks.abs().amax(dim=(1, 3), keepdim=True), min=1e-10) / 448.0
    q = torch.clamp(blocks * (1.0 / s), -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view_as(x)[:n, :k], s.view(s.shape[0], s.shape[2])


def vllm_per_tensor_copy(w: torch.Tensor):
    """A copy of vLLM 0.32's ``Fp8PerTensorOnlineLinearMethod.process_weights_after_loading`` on a fused weight:
    ``s = fp32(amax) / tensor(448.)`` (``_fp8_scale``), codes by ``ops.scaled_fp8_quant``'s static kernel:
    ``clamp(x * (1 / s))`` (vLLM's comment in ``_fp8_quant_per_channel``: it multiplies by the reciprocal)."""
    s = w.abs().amax().float() / torch.tensor(448.0)
    return torch.clamp(w.float() * (1.0 / s), -448.0, 448.0).to(torch.float8_e4m3fn), s.reshape(1)


def fused_rows(tensors: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n] for n in names])


QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
DOWN = "model.layers.0.mlp.down_proj.weight"


def test_each_preset_with_nearest_serves_the_stacks_bytes():
    """verl (installed), vLLM per channel and per block (the engine's functions), verl's Triton path and vLLM per
    tensor (cited copies): codes and scales bit for bit, from bf16(master), on rows cut by the blocks, zero rows,
    blocks under the floors; per tensor and per block in vLLM's fused qkv_proj coordinates."""
    masters = masters_of()
    bf16 = {n: m.bfloat16() for n, m in masters.items()}
    per_channel, per_block = vllm_online()
    stacks = {
        "verl": lambda w: (lambda q, s: (q, s.reshape(s.shape[0], s.shape[1])))(*verl_quantizer()(w, [128, 128])),
        "verl-triton": verl_triton_copy,
        "vllm-fp8-per-channel": per_channel,
        "vllm-fp8-per-block": per_block,
        "vllm-fp8-per-tensor": vllm_per_tensor_copy,
    }
    for rule, stack in stacks.items():
        served, _ = export({"mode": "nearest", "format": "fp8", "fp8_rule": rule, "fp8_exclude": ""}, masters)
        scale = PRESETS[rule].scale_name
        layers = [QKV, [DOWN]] if rule in ("vllm-fp8-per-block", "vllm-fp8-per-tensor") else [[n] for n in masters]
        for names in layers:
            q, s = stack(fused_rows(bf16, names))
            ours = fused_rows(served, names)
            assert torch.equal(bits(ours), bits(q)), f"{rule}: codes of {names[0]}: {int((bits(ours) != bits(q)).sum())} differ"
            scales = [served[n[:-len("weight")] + scale] for n in names]
            if PRESETS[rule].granularity == "tensor":
                assert all(torch.equal(bits(t), bits(s.reshape(t.shape))) for t in scales), f"{rule}: scale of {names}"
            else:
                assert torch.equal(bits(torch.cat(scales)), bits(s.reshape(-1, scales[0].shape[1]))), \
                    f"{rule}: scales of {names[0]}"


@pytest.mark.parametrize("rule", ["verl", "vllm-fp8-per-channel", "vllm-fp8-per-block"])
@pytest.mark.parametrize("method", ["dithered", "stochastic", "error_feedback"])
def test_the_stacks_quantizer_returns_a_fair_casts_codes_from_its_bf16_values(rule, method):
    """The grid route: a fair method under a preset serves codes ``q`` and scales ``s`` such that the stack's own
    quantizer, given ``bf16(q * s)``, returns ``q`` and ``s`` bit for bit (each group's largest element codes
    ±448 and its scale is what the stack recomputes from the bf16 values), for the masters in fp32."""
    masters = masters_of(1)
    per_channel, per_block = vllm_online()
    stack = {"verl": lambda w: verl_quantizer()(w, [128, 128]), "vllm-fp8-per-channel": per_channel,
             "vllm-fp8-per-block": per_block}[rule]
    config = {"mode": "fair", "method": method, "format": "fp8", "fp8_rule": rule, "fp8_exclude": "", "seed": 5}
    served, _ = export(config, masters, steps=2)
    nearest, _ = export({**config, "mode": "nearest", "method": "stochastic"}, masters)
    scale_name = PRESETS[rule].scale_name
    rule = PRESETS[rule]
    for names in ([DOWN], QKV):
        q = fused_rows(served, names)
        s = torch.cat([served[n[:-len("weight")] + scale_name] for n in names])
        sent = rule.grid(q, s) if names == [DOWN] else torch.cat([rule.grid(served[n], served[n[:-6] + scale_name])
                                                                   for n in names])
        for q2, s2 in (stack(sent), rule.quantize(sent)):
            assert torch.equal(bits(q2), bits(q)), f"{names[0]}: {int((bits(q2) != bits(q)).sum())} codes changed"
            assert torch.equal(bits(s2.reshape(s.shape)), bits(s)), f"{names[0]}: scales changed"
        assert not torch.equal(bits(q), bits(fused_rows(nearest, names))), "the fair cast served nearest's codes"


def test_recomputed_scales_follow_the_masters_and_count_as_rescales():
    """A recomputed rule sets every scale from this export's masters, where faircast's sticky rule keeps a scale
    while its channel fits; the rescales count the scales whose value changed."""
    for rule, config in (("vllm-fp8-per-channel", {"fp8_rule": "vllm-fp8-per-channel"}), ("faircast", {})):
        masters = masters_of(3)
        state = ExportState({"mode": "nearest", "format": "fp8", "fp8_exclude": "", **config},
                            shapes={n: tuple(m.shape) for n, m in masters.items()})
        pieces = [Shard(n, m.reshape(-1), torch.empty(m.numel(), dtype=torch.bfloat16), [(n, 0, m.numel(), 0)])
                  for n, m in masters.items()]
        state.export(pieces)
        before = {n: t.clone() for n, t in state.fp8.scales.items()}
        masters[DOWN].mul_(0.5)  # every channel's maximum halves
        state.export(pieces)
        changed = sum(int((state.fp8.scales[n] != before[n]).sum()) for n in masters)
        assert state.fp8.last_rescales == changed
        if rule == "faircast":
            assert changed == 0
        else:
            want = state.fp8.rule.scales(masters[DOWN].bfloat16().float().abs().amax(1, keepdim=True))
            assert torch.equal(bits(state.fp8.scales[DOWN]), bits(want))
            assert changed == int((want != before[DOWN]).sum()) > 150


def test_bad_rules_are_refused_by_name():
    with pytest.raises(ConfigError, match="fp8_rule must be one of") as err:
        ExportCastConfig(format="fp8", fp8_rule="vllm-per-channel")
    assert err.value.field == "fp8_rule"
    with pytest.raises(ConfigError, match="fp8_scales is set but fp8_rule 'verl' sets the scales"):
        ExportCastConfig(format="fp8", fp8_rule="verl", fp8_scales="block")
    with pytest.raises(ConfigError, match="fp8_rule is set but format is 'bf16'"):
        ExportCastConfig(fp8_rule="verl")
    with pytest.raises(ValueError, match="ue8m0 takes formula 'tight'"):
        ScaleRule("block", ue8m0=True, formula="amax/448")
    with pytest.raises(ValueError, match="recomputed at every export"):
        ScaleRule("block", formula="448/amax")
    # vLLM's per-block engine blocks of qkv_proj straddle q and k when q's rows are not a multiple of 128
    shapes = {**SHAPES, QKV[0]: (192, 200)}
    with pytest.raises(ValueError, match=r"blocks of 'model.layers.0.self_attn.qkv_proj' straddle .*"
                                         r"'model.layers.0.self_attn.q_proj.weight' bf16"):
        ExportState({"mode": "nearest", "format": "fp8", "fp8_rule": "vllm-fp8-per-block", "fp8_exclude": ""},
                    shapes=shapes)
    ExportState({"mode": "nearest", "format": "fp8", "fp8_rule": "verl", "fp8_exclude": ""}, shapes=shapes)


def test_the_install_line_names_the_rule():
    from faircast_dist.export import fp8_note
    state = ExportState({"mode": "nearest", "format": "fp8", "fp8_rule": "verl"}, shapes=SHAPES)
    assert "fp8_rule 'verl': block scales, recomputed each export, round-to-nearest via bf16" in fp8_note(state)


@pytest.mark.parametrize("method", ["dithered", "error_feedback"])
def test_fp8_grid_puts_the_served_values_in_the_bf16_params(method):
    """``fp8_grid``: after every export the bf16 params of the FP8 weights hold ``bf16(q * s)`` (shards cutting rows
    and blocks included), and verl's own quantizer, given them, returns faircast's codes and scales; the other params
    are what they are without ``fp8_grid``."""
    masters = {**masters_of(4), "model.norm.weight": torch.randn(200)}
    shapes = {n: tuple(m.shape) for n, m in masters.items()}
    config = {"mode": "fair", "method": method, "format": "fp8", "fp8_rule": "verl", "seed": 3}
    states = {grid: ExportState({**config, "fp8_grid": grid}, shapes=shapes) for grid in (True, False)}
    pieces, outs = {True: [], False: []}, {True: {}, False: {}}
    for grid, n in itertools.product((True, False), masters):  # two shards per param, cut inside a row and a block
        flat, cut = masters[n].reshape(-1), masters[n].numel() // 2 + 37
        out = outs[grid][n] = torch.empty(flat.numel(), dtype=torch.bfloat16)
        pieces[grid] += [Shard((n, 0), flat[:cut], out[:cut], [(n, 0, cut, 0)]),
                         Shard((n, 1), flat[cut:], out[cut:], [(n, 0, flat.numel() - cut, cut)])]
    quantizer, rule = verl_quantizer(), PRESETS["verl"]
    for step in range(2):
        for grid in (True, False):
            states[grid].export(pieces[grid])
        full = states[True].full_fp8(pieces[True])
        for n in full:
            q, s = full[n], states[True].fp8.scales[n]
            params = outs[True][n].view(shapes[n])
            assert torch.equal(bits(params), bits(rule.grid(q, s))), f"export {step}: {n}"
            q2, s2 = quantizer(params, [128, 128])
            assert torch.equal(bits(q2), bits(q)) and torch.equal(bits(s2.reshape(s.shape)), bits(s)), n
            assert not torch.equal(bits(params), bits(outs[False][n].view(shapes[n]))), n
        assert torch.equal(bits(outs[True]["model.norm.weight"]), bits(outs[False]["model.norm.weight"]))
        for m in masters.values():
            m.add_(torch.randn(m.shape) * 1e-3)


def test_fp8_grid_needs_a_recomputed_rule_and_says_so():
    from faircast_dist.export import fp8_note
    for rule in (None, "deepseek-ue8m0"):
        with pytest.raises(ConfigError, match="fp8_grid needs an fp8_rule whose scales are recomputed") as err:
            ExportCastConfig(format="fp8", fp8_rule=rule, fp8_grid=True)
        assert err.value.field == "fp8_grid"
    state = ExportState({"mode": "nearest", "format": "fp8", "fp8_rule": "verl", "fp8_grid": True}, shapes=SHAPES)
    assert "the bf16 params of those weights hold the served FP8 values (fp8_grid): the trainer computes with them" \
        in fp8_note(state)


def test_nearest_under_a_preset_changes_nothing_the_stack_serves():
    """The meter: ``mode "nearest"`` with a preset leaves the bf16 params stock (round-to-nearest of the masters), and
    the FP8 copy whose telemetry the monitor shows is, byte for byte, what the stack's quantizer serves from them."""
    masters = masters_of(5)
    state = ExportState({"mode": "nearest", "format": "fp8", "fp8_rule": "verl", "fp8_exclude": ""},
                        shapes={n: tuple(m.shape) for n, m in masters.items()})
    outs = {n: torch.empty(m.numel(), dtype=torch.bfloat16) for n, m in masters.items()}
    pieces = [Shard(n, m.reshape(-1), outs[n], [(n, 0, m.numel(), 0)]) for n, m in masters.items()]
    state.export(pieces)
    full, quantizer = state.full_fp8(pieces), verl_quantizer()
    for n, m in masters.items():
        assert torch.equal(bits(outs[n]), bits(m.reshape(-1).bfloat16())), n
        q, s = quantizer(outs[n].view(m.shape), [128, 128])
        assert torch.equal(bits(full[n]), bits(q)) and torch.equal(bits(state.fp8.scales[n]), bits(s.reshape(-1, s.shape[1]))), n
