"""Edge cases of the FP8 scale rules (faircast_dist.fp8.PRESETS), fp8_grid and faircast-fp8-grid that a review
found failing (each test failed before its fix; single process, CPU, a second each): tiny groups, a vLLM fused
layer kept part bf16, error feedback at fp32 max, odd masters and config.json in the grid meter."""
import json

import pytest
import torch

from faircast_dist.export import ExportState, Shard
from faircast_dist.fp8 import PRESETS
from helpers import bits

DOWN = "model.layers.0.mlp.down_proj.weight"
QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]


def shards_of(masters: dict, cuts: int = 2):
    """Shards cutting each param inside a row (as ranks would), and the bf16 outs."""
    pieces, outs = [], {}
    for n, m in masters.items():
        flat = m.reshape(-1)
        out = outs[n] = torch.zeros(flat.numel(), dtype=torch.bfloat16)
        edges = sorted({0, flat.numel(), *(min(flat.numel(), flat.numel() * i // cuts + 7) for i in range(1, cuts))})
        for a, b in zip(edges, edges[1:]):
            pieces.append(Shard((n, a), flat[a:b], out[a:b], [(n, 0, b - a, a)]))
    return pieces, outs


@pytest.mark.parametrize("rule", ["verl", "vllm-fp8-per-tensor"])
@pytest.mark.parametrize("mode", ["nearest", "fair"])
def test_a_group_whose_absmax_is_tiny_exports(rule, mode):
    """A block (verl) or tensor (vLLM per tensor) whose largest |master| is tiny but not 0 (here 1e-37, below
    448 / fp32 max): 448 / amax and 1 / (amax / 448) overflow to Inf, ScaleRule.factors returns scale 0 / multiplier
    Inf (its docstring: finite and > 0), and the export raises ValueError from fused.cast_fp8 ("scales[0] is 0.0" /
    "multipliers[0] is inf"): one such block stops training. Should export, serving finite codes (0 where the
    master is 0) and finite scales > 0."""
    m = torch.zeros(256, 256)
    m[0, 0] = 1e-37
    state = ExportState({"mode": mode, "format": "fp8", "fp8_rule": rule, "fp8_exclude": ""},
                        shapes={DOWN: tuple(m.shape)})
    pieces, _ = shards_of({DOWN: m})
    state.export(pieces)
    q = state.full_fp8(pieces)[DOWN].float()
    assert not bool(torch.isnan(q).any())
    scales, mult = PRESETS[rule].factors(torch.tensor([1e-37]))
    assert bool(torch.isfinite(scales).all() & (scales > 0).all()), f"{rule}: factors gave scale {scales}"
    assert mult is None or bool(torch.isfinite(mult).all()), f"{rule}: factors gave multiplier {mult}"


@pytest.mark.parametrize("rule", ["verl", "vllm-fp8-per-tensor"])
def test_quantize_of_a_tiny_group_serves_no_nan(rule):
    """ScaleRule.quantize (the grid route's reference, and faircast-fp8-grid's rule_cast) of a weight whose group
    maximum is 1e-37: 0 * Inf gives NaN codes for every zero element."""
    w = torch.zeros(128, 128)
    w[0, 0] = 1e-37
    q, s = PRESETS[rule].quantize(w)
    assert not bool(torch.isnan(q.float()).any()), f"{rule}: {int(torch.isnan(q.float()).sum())} NaN codes, scale {s}"


@pytest.mark.parametrize("rule, excluded", [("vllm-fp8-per-tensor", "k_proj"), ("vllm-fp8-per-block", "k_proj")])
def test_an_engine_group_with_an_excluded_part_is_refused(rule, excluded):
    """An engine_fused rule over vLLM's qkv_proj, with k_proj kept bf16 by fp8_exclude: the engine quantizes the
    whole fused layer (k included), but faircast's group scale (per tensor) ignores k, and the straddle check (per
    block) skips k's 72 rows, so v's blocks are not the engine's. The export is accepted silently and the engine's
    own quantizer, given the bf16 params (the grid route), changes q's and v's codes. Should be refused by name
    (as the straddle case is), or k counted in the group."""
    shapes = {QKV[0]: (256, 200), QKV[1]: (72, 200), QKV[2]: (72, 200)}
    config = {"mode": "fair", "method": "stochastic", "format": "fp8", "fp8_rule": rule, "fp8_exclude": excluded,
              "fp8_grid": True}
    with pytest.raises(ValueError, match="k_proj"):
        ExportState(config, shapes=shapes)


def error_feedback_at_fp32_max(rule: str, shape: tuple[int, int], masters: torch.Tensor):
    """An error-feedback export state under ``rule`` and one shard of ``masters`` with element [0, 0] at fp32 max."""
    masters[0, 0] = torch.finfo(torch.float32).max
    state = ExportState({"mode": "fair", "method": "error_feedback", "format": "fp8", "fp8_rule": rule,
                         "fp8_exclude": ""}, shapes={DOWN: shape})
    return state, shards_of({DOWN: masters}, cuts=1)[0]


def test_nonsticky_error_feedback_keeps_a_huge_master_in_its_scale():
    """Error feedback under verl's rule (scales recomputed every export) with a master of 3.4e38 (finite): after
    the first export master + residual overflows, fp8_absmax leaves it out (not finite) while the cast saturates it
    at fp32 max, so the block's scale is set from the other elements: the master is served as ~0.16 and its residual
    pinned at 3.4e38 for good. Should: the absmax see the saturated value, as the cast does."""
    state, pieces = error_feedback_at_fp32_max(
        "verl", (4, 300), torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 0.02)
    for _ in range(3):
        state.export(pieces)
        served = state.full_fp8(pieces)[DOWN].float()[0, 0] * state.fp8.scales[DOWN].reshape(-1)[0]
        assert float(served) > 1e38, f"a master of 3.4e38 served as {float(served)}"


def test_ue8m0_error_feedback_at_fp32_max_stays_finite():
    """UE8M0 scales (deepseek-ue8m0, also fp8_ue8m0) with error feedback and a master at fp32 max: the scale is
    2**120, the code 256, and q * s = 2**128 overflows: the served value is Inf, the residual -Inf, and the next
    export serves -256 (sign flipped), alternating. cast_fp8_error_feedback's docstring: for a finite master, q and
    the residual stay finite."""
    state, pieces = error_feedback_at_fp32_max("deepseek-ue8m0", (4, 128), torch.zeros(4, 128))
    for _ in range(2):
        state.export(pieces)
        q = state.full_fp8(pieces)[DOWN].float()[0, 0]
        assert bool(torch.isfinite(state.fp8_residuals[(DOWN, 0)]).all()), "non-finite FP8 residual"
        assert float(q) > 0, f"code {float(q)} for a master of +3.4e38"


# ------------------------------------------------------------------------------------------- faircast-fp8-grid
safetensors_torch = pytest.importorskip("safetensors.torch")


def _ckpt(tmp_path, masters_value=None, config=None):
    from faircast_dist import fp8_grid
    w = (torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    q, s = PRESETS["verl"].quantize(w)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    safetensors_torch.save_file({DOWN: q, DOWN[:-len("weight")] + "weight_scale_inv": s}, str(folder / "m.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(config)
    masters = None
    if masters_value is not None:
        masters = str(tmp_path / "masters.safetensors")
        safetensors_torch.save_file({DOWN: masters_value}, masters)
    return fp8_grid, str(folder), masters


@pytest.mark.parametrize("case", ["bf16 overflow", "tiny block with zeros"])
def test_fp8_grid_measures_odd_masters(tmp_path, case):
    """faircast-fp8-grid with finite masters that its rule turns non-finite: one master above bf16's max (bf16
    rounds it to Inf) or a block whose maximum is 1e-37 beside zeros (verl's 448 / amax is Inf, 0 * Inf NaN): the
    distance is NaN and torch.bincount raises a raw RuntimeError ("bincount only supports 1-d non-negative integral
    inputs"), a traceback instead of a report or exit status 2."""
    m = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 0.02
    if case == "bf16 overflow":
        m[5, 5] = 3.3962e38
    else:
        m = torch.zeros(200, 300)
        m[0, 0] = 1e-37
    fp8_grid, ckpt, masters = _ckpt(tmp_path, m)
    rep = fp8_grid.report(ckpt, masters)
    assert rep["total"]["elements"] == 60000


@pytest.mark.parametrize("config", ["[1, 2]", json.dumps({"quantization_config": "fp8"})])
def test_fp8_grid_refuses_an_odd_config_json_by_name(tmp_path, config):
    """A config.json that is JSON but not an object, or a quantization_config that is not an object: an
    AttributeError traceback instead of Fp8GridError naming config.json."""
    fp8_grid, ckpt, _ = _ckpt(tmp_path, config=config)
    with pytest.raises(fp8_grid.Fp8GridError, match="config.json"):
        fp8_grid.report(ckpt)
