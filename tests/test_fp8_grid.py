"""faircast-fp8-grid (faircast_dist/fp8_grid.py): on small synthetic FP8 checkpoints written with safetensors, masters
on the grid are reported on it and frozen, masters moved less than half a spacing keep every code under
round-to-nearest (a dithered cast changes some), off-grid masters are not frozen, scale groups below 448 are counted
and regridded, per-channel and per-tensor layouts (vLLM's fused qkv under a per-tensor rule), the block size from
config.json, and bad inputs refused by name."""
import json
import math
import os
import re

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from faircast_dist import fp8_grid  # noqa: E402
from faircast_dist.fp8 import PRESETS  # noqa: E402
from faircast_dist.fp8_grid import E4M3_VALUES, Fp8GridError, boundary_distance, report, rule_cast  # noqa: E402
from faircast_dist.rounding import cast_fp8_stochastic, e4m3_round  # noqa: E402
from helpers import bits  # noqa: E402

SHAPES = {"model.layers.0.mlp.down_proj.weight": (200, 300), "model.layers.0.self_attn.o_proj.weight": (128, 256)}
QKV = {f"model.layers.0.self_attn.{p}_proj.weight": (n, 192) for p, n in (("q", 192), ("k", 64), ("v", 64))}


def weights_of(shapes=SHAPES, seed=0) -> dict:
    """bf16 ``[N, K]`` weights, N(0, 0.02) times a per-tensor factor."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02 * (i + 1)).bfloat16() for i, (n, s) in enumerate(shapes.items())}


def quantize(weights: dict, rule: str) -> dict:
    """``{name: codes, scale name: scales}``: each weight quantized alone under ``PRESETS[rule]``; a bf16 norm."""
    out = {"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    for name, w in weights.items():
        out[name], out[name + PRESETS[rule].scale_name[len("weight"):]] = PRESETS[rule].quantize(w)
    return out


def dequantized(ckpt: dict, rule: str) -> dict:
    """fp32 ``q * s`` of each FP8 weight (the checkpoint's own layout is ``rule``'s)."""
    suffix = PRESETS[rule].scale_name[len("weight"):]
    return {n: q.float() * PRESETS[rule].element_scales(ckpt[n + suffix].float(), tuple(q.shape))
            for n, q in ckpt.items() if q.dtype == torch.float8_e4m3fn}


def save(path, tensors: dict) -> str:
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def neighbour_gaps(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gaps from E4M3 values ``q`` (fp32) to the next value below and above (inf past ±448)."""
    i = torch.searchsorted(E4M3_VALUES, q.contiguous())
    lo = torch.where(i > 0, q - E4M3_VALUES[(i - 1).clamp(min=0)], float("inf"))
    hi = torch.where(i < len(E4M3_VALUES) - 1, E4M3_VALUES[(i + 1).clamp(max=len(E4M3_VALUES) - 1)] - q, float("inf"))
    return lo, hi


@pytest.mark.parametrize("rule", ["verl", "vllm-fp8-per-channel", "vllm-fp8-per-tensor"])
def test_the_checkpoint_dequantized_is_on_the_grid_and_frozen(tmp_path, rule):
    """Masters = the checkpoint dequantized (default, or given as fp32 or as DeepSeek's bf16 dequantization): 100%
    on the grid, 100% codes and served values unchanged under the layout's default rule, every group at 448, the
    distance 0.5 spacing less the bf16 rounding (at most 2**-8 of the value, 1/16 spacing), verdict frozen."""
    ckpt = quantize(weights_of(), rule)
    path = save(tmp_path / "ckpt.safetensors", ckpt)
    grid = dequantized(ckpt, rule)
    fp32 = save(tmp_path / "fp32.safetensors", grid)
    bf16 = save(tmp_path / "bf16.safetensors", {n: t.bfloat16() for n, t in grid.items()})
    for masters in (None, fp32, bf16):
        rep = report(path, masters)
        t = rep["total"]
        assert rep["rules"] == [rule] and rep["skipped"] == 1, rep["rules"]
        assert t["elements"] == sum(math.prod(s) for s in SHAPES.values())
        assert t["on_grid_bf16"] == 1.0 and t["codes_unchanged"] == 1.0, (masters, t)
        assert t["on_grid"] == 1.0 if masters != bf16 else t["on_grid"] < 0.5, (masters, t["on_grid"])
        assert t["served_unchanged"] == 1.0
        assert t["groups_below_448"] == 0 and t["groups_at_448"] == 1.0
        assert t["distance"]["p1"] >= 0.5 - 1 / 16 - 1 / 8192 and t["distance"]["p50"] > 0.45, t["distance"]
        assert rep["verdict"]["frozen"] and rep["verdict"]["text"].startswith("frozen: round-to-nearest")
        assert {r["layout"] for r in rep["tensors"].values()} == {PRESETS[rule].granularity}


def test_channel_and_tensor_scales_of_other_shapes(tmp_path):
    """Channel scales ``[N]`` and tensor scales ``[]`` (a scalar) read like ``[N, 1]`` and ``[1]``."""
    for rule, shape in (("vllm-fp8-per-channel", (-1,)), ("vllm-fp8-per-tensor", ())):
        ckpt = quantize(weights_of(), rule)
        want = report(save(tmp_path / "a.safetensors", ckpt))
        ckpt = {k: v.reshape(shape) if k.endswith("_scale") else v for k, v in ckpt.items()}
        got = report(save(tmp_path / "b.safetensors", ckpt))
        assert got["total"] == want["total"] and got["total"]["on_grid"] == 1.0


def test_masters_moved_less_than_half_a_spacing_keep_every_code(tmp_path):
    """Each master moved by u of the gap to its neighbour on that side, |u| < 0.4 (the blocks' ±448 elements kept,
    so the recomputed scales stay): nearest keeps every code, almost none is on the grid, the nearest master is
    still >= 0.1 - 1/32 spacing from a boundary; a dithered cast of the same masters changes about E|u| = 0.2 of
    them."""
    ckpt = quantize(weights_of(), "verl")
    grid = dequantized(ckpt, "verl")
    g = torch.Generator().manual_seed(1)
    moved = {}
    for name, w in grid.items():
        q = ckpt[name].float()
        s = PRESETS["verl"].element_scales(ckpt[name + "_scale_inv"], tuple(q.shape))
        u = (torch.rand(q.shape, generator=g) - 0.5) * 0.8
        u = torch.where(q.abs() == 448, 0.0, u)
        lo, hi = (gap.clamp(max=32) for gap in neighbour_gaps(q))  # 0 * inf past ±448 would be NaN
        moved[name] = (q + torch.where(u > 0, u * hi, u * lo)) * s
    rep = report(save(tmp_path / "ckpt.safetensors", ckpt), save(tmp_path / "m.safetensors", moved))
    t = rep["total"]
    assert t["codes_unchanged"] == 1.0, t
    assert t["on_grid"] < 0.01 and t["on_grid_bf16"] < 0.1, t
    assert 0.1 - 1 / 32 <= t["distance"]["p1"] and 0.25 < t["distance"]["p50"] < 0.35, t["distance"]
    changed = total = 0
    for name, m in moved.items():
        s = PRESETS["verl"].element_scales(ckpt[name + "_scale_inv"], tuple(m.shape)).contiguous()
        dithered = cast_fp8_stochastic(m.contiguous(), s, (7, 0), 0)
        changed += int((dithered.float() != ckpt[name].float()).sum())
        total += m.numel()
    assert 0.15 < changed / total < 0.25, changed / total


def test_off_grid_masters_are_not_frozen(tmp_path):
    """Masters of a bf16 model, the checkpoint quantized from them: off the grid (about 2% exactly on it, where
    verl's scale makes ``q * s`` a bf16 value; ~1/16 on its bf16 rounding), every code unchanged (the checkpoint is
    their round-to-nearest), the median distance ~0.25, not frozen."""
    weights = weights_of(seed=3)
    rep = report(save(tmp_path / "ckpt.safetensors", quantize(weights, "verl")),
                 save(tmp_path / "m.safetensors", weights))
    t = rep["total"]
    assert t["on_grid"] < 0.05 and t["on_grid_bf16"] < 0.1, t
    assert t["codes_unchanged"] == 1.0 and t["served_unchanged"] == 1.0
    assert 0.22 < t["distance"]["p50"] < 0.28 and t["distance"]["p1"] < 0.01, t["distance"]
    assert not rep["verdict"]["frozen"] and rep["verdict"]["text"].startswith("not frozen: the masters")


def test_a_block_below_448_is_counted_and_regridded(tmp_path):
    """A block whose codes are halved and scale doubled (the same served values, largest code 224): counted below
    448; a stack recomputing its scale (verl) serves every nonzero code of that block changed, the others not."""
    ckpt = quantize(weights_of(), "verl")
    name = "model.layers.0.mlp.down_proj.weight"
    q = ckpt[name].float()
    block = q[:128, 128:256]
    q[:128, 128:256] = (block / 2).to(torch.float8_e4m3fn).float()
    ckpt[name] = q.to(torch.float8_e4m3fn)
    ckpt[name + "_scale_inv"][0, 1] *= 2
    rep = report(save(tmp_path / "ckpt.safetensors", ckpt))
    r = rep["tensors"][name]
    assert (r["groups"], r["groups_below_448"], r["groups_at_448"]) == (6, 1, 5 / 6)
    assert rep["total"]["groups_below_448"] == 1 and rep["total"]["groups"] == 8
    nonzero = int((q[:128, 128:256] != 0).sum())
    assert r["codes_unchanged"] == 1 - nonzero / q.numel(), (r["codes_unchanged"], nonzero)
    assert rep["tensors"]["model.layers.0.self_attn.o_proj.weight"]["codes_unchanged"] == 1.0
    assert "of the codes change at the next sync under verl" in rep["verdict"]["text"]


def test_a_sticky_rule_keeps_the_checkpoints_scales(tmp_path):
    """A UE8M0 checkpoint (DeepSeek-V3.1 style) with a block's codes halved and its scale doubled: the sticky
    deepseek-ue8m0 rule keeps that scale (it fits) and every code; fresh power-of-two scales would halve it; verl's
    recomputed scales (448 / amax) move every block whose largest code is not 448. Channel scales do not seed it."""
    ckpt = quantize(weights_of(), "deepseek-ue8m0")
    name = "model.layers.0.mlp.down_proj.weight"
    q = ckpt[name].float()
    q[128:, :128] = (q[128:, :128] / 2).to(torch.float8_e4m3fn).float()
    ckpt[name] = q.to(torch.float8_e4m3fn)
    ckpt[name + "_scale_inv"][1, 0] *= 2
    path = save(tmp_path / "ckpt.safetensors", ckpt)
    rep = report(path, rule="deepseek-ue8m0")
    assert rep["total"]["codes_unchanged"] == 1.0 and rep["total"]["served_unchanged"] == 1.0, rep["total"]
    assert rep["tensors"][name]["groups_below_448"] >= 1 and rep["verdict"]["frozen"]
    _, _, s = rule_cast("deepseek-ue8m0", dequantized(ckpt, "deepseek-ue8m0")[name])  # fresh scales
    assert float(s[128, 0]) == float(ckpt[name + "_scale_inv"][1, 0]) / 2
    rep = report(path)
    below = rep["total"]["groups_below_448"]
    assert rep["rules"] == ["verl"] and below > 1 and rep["total"]["codes_unchanged"] < 0.9, rep["total"]
    # channel scales are not its layout: it starts from fresh block scales, and regrids the channels
    rep = report(save(tmp_path / "channel.safetensors", quantize(weights_of(), "vllm-fp8-per-channel")),
                 rule="deepseek-ue8m0")
    assert rep["total"]["codes_unchanged"] < 0.9, rep["total"]


def test_engine_fused_rules_quantize_vllms_fused_qkv(tmp_path):
    """Per-tensor scales of q, k and v (q the largest): vLLM's per-tensor rule quantizes qkv_proj with one scale,
    q's, so q keeps its codes and k and v change most of theirs; o_proj, alone, keeps them. vLLM's per-block rule
    takes the blocks of the fused rows q, k, v in that order (q's 192 rows put k's first 64 in q's second block):
    each part's unchanged codes are those of ScaleRule.quantize of the fused layer of masters."""
    shapes = {**QKV, "model.layers.0.self_attn.o_proj.weight": (128, 256)}
    weights = weights_of(shapes)
    weights = {n: w * (4.0 if ".q_proj" in n else 1.0) for n, w in weights.items()}
    path = save(tmp_path / "ckpt.safetensors", quantize(weights, "vllm-fp8-per-tensor"))
    rep = report(path)
    same = {n.split(".")[-2]: r["codes_unchanged"] for n, r in rep["tensors"].items()}
    assert same["q_proj"] == 1.0 and same["o_proj"] == 1.0, same
    assert same["k_proj"] < 0.5 and same["v_proj"] < 0.5, same
    assert [rep["tensors"][n]["shape"] for n in QKV] == [[192, 192], [64, 192], [64, 192]]
    rep = report(path, rule="vllm-fp8-per-block")
    ckpt = quantize(weights, "vllm-fp8-per-tensor")
    grid = dequantized(ckpt, "vllm-fp8-per-tensor")  # the masters
    fused, _ = PRESETS["vllm-fp8-per-block"].quantize(torch.cat([grid[n] for n in QKV]))
    for name, part in zip(QKV, fused.float().split([192, 64, 64])):
        want = int((part == ckpt[name].float()).sum()) / part.numel()
        assert rep["tensors"][name]["codes_unchanged"] == want, name
    assert len({rep["tensors"][n]["codes_unchanged"] for n in QKV}) == 3


def test_the_block_size_comes_from_config_json(tmp_path):
    """A folder of two files with 64x64 block scales and config.json's weight_block_size [64, 64]: on the grid,
    ceil(200/64) * ceil(300/64) groups; without the config the scales' shape is refused naming config.json; verl's
    128x128 blocks regrid it (codes change)."""
    w = weights_of()["model.layers.0.mlp.down_proj.weight"].float()
    x = torch.nn.functional.pad(w, (0, 20, 0, 56)).view(4, 64, 5, 64)
    s = (x.abs().amax(dim=(1, 3)) / 448).clamp(min=2.0 ** -126)
    q = e4m3_round((x / s[:, None, :, None]).view(256, 320)[:200, :300].contiguous())
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save(folder / "model-00001-of-00002.safetensors", {"a.weight": q})
    save(folder / "model-00002-of-00002.safetensors", {"a.weight_scale_inv": s})
    with pytest.raises(Fp8GridError, match=r"'a.weight_scale_inv' have shape \[4, 5\].*blocks of 128x128 need \[2, 3\]"
                                           r".*config.json"):
        report(str(folder))
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [64, 64]}}))
    rep = report(str(folder))
    r = rep["tensors"]["a.weight"]
    assert rep["block_size"] == [64, 64] and r["groups"] == 20 and r["on_grid"] == 1.0
    assert r["codes_unchanged"] < 0.9, r["codes_unchanged"]


def test_the_tools_codes_are_the_rules():
    """rule_cast's codes and scales are ScaleRule.quantize's, bit for bit, for every preset (a zero row, a block
    of tiny values, an outlier, an Inf), and its distances stay in [0, 0.5]."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=g) * 0.02
    w[3] = 0
    w[128:, 128:256] = torch.randn(72, 128, generator=g) * 1e-7
    w[5, 7] = 0.5
    w[9, 9] = float("inf")
    for name, rule in PRESETS.items():
        y, q, s = rule_cast(name, w)
        codes, scales = rule.quantize(w)
        assert torch.equal(bits(q.to(torch.float8_e4m3fn)), bits(codes)), name
        assert torch.equal(bits(s), bits(rule.element_scales(scales, (200, 300)))), name
        finite = torch.isfinite(w)
        d = boundary_distance(y[finite], q[finite])
        assert bool((d >= 0).all() and (d <= 0.5).all()), name


def test_boundary_distance():
    """0.5 on the grid (also at 1, where the gap below is half the gap above, and at ±448 and 0); 0 on a midpoint;
    a move of 0.1 of the gap leaves 0.4."""
    q = torch.tensor([1.0, 448.0, -448.0, 0.0, 1.0, 1.0, 1.0, -2.0, 2.0 ** -9])
    y = torch.tensor([1.0, 448.0, -448.0, 0.0, 1.0 + 0.0125, 1.0 - 1 / 32, 1 + 1 / 16, -2.0 - 0.025, 2.0 ** -9])
    assert boundary_distance(y, q).tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.4, 0.0, 0.0, 0.4, 0.5])


def test_the_console_script_prints_a_table_and_json(tmp_path, capsys):
    """``main``: the table (a row per weight, at most ``--rows``, the total, the verdict), ``--json`` (the report),
    and setup.py's entry point names it."""
    path = save(tmp_path / "ckpt.safetensors", quantize(weights_of(), "verl"))
    assert fp8_grid.main([path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report(path)))
    assert fp8_grid.main([path, "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^model\.layers\.0\.mlp\.down_proj +block +60000 +100% ", out, re.M), out
    assert "o_proj" not in out and "... 1 more (--rows 0 shows all)" in out
    assert re.search(r"^total \(2 FP8 weights\) +92768 ", out, re.M) and "\nverdict: frozen: " in out, out
    setup = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py")).read()
    assert '"faircast-fp8-grid=faircast_dist.fp8_grid:main"' in setup


def _bad(tmp_path, case):
    """``(checkpoint path, masters path or None)`` for a bad-input case."""
    ckpt = quantize(weights_of(), "verl")
    a, b = list(SHAPES)
    masters = None
    if case == "missing scales":
        del ckpt[b + "_scale_inv"]
    elif case == "bf16 weight with scales":
        ckpt[b] = ckpt[b].bfloat16()
    elif case == "e5m2 weight with scales":
        ckpt[b] = ckpt[b].float().to(torch.float8_e5m2)
    elif case == "scales of the wrong shape":
        ckpt[b + "_scale_inv"] = ckpt[b + "_scale_inv"][:, :1]
    elif case == "both scale names":
        ckpt[b + "_scale"] = torch.ones(128, 1)
    elif case == "3-D weight":
        ckpt[b] = ckpt[b].view(2, 64, 256)
    elif case == "int scales":
        ckpt[b + "_scale_inv"] = ckpt[b + "_scale_inv"].to(torch.int32)
    elif case == "no FP8 weight":
        ckpt = weights_of()
    elif case == "masters missing a tensor":
        masters = save(tmp_path / "m.safetensors", {a: weights_of()[a]})
    elif case == "masters of another shape":
        masters = save(tmp_path / "m.safetensors", {**weights_of(), b: torch.zeros(256, 128)})
    elif case == "FP8 masters":
        masters = str(tmp_path / "m.safetensors")
        save(masters, {**weights_of(), b: ckpt[b]})
    elif case == "no such path":
        return str(tmp_path / "nothing"), None
    elif case == "empty folder":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty"), None
    elif case == "not safetensors":
        (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
        return str(tmp_path / "junk.safetensors"), None
    elif case in ("bad block size", "a key in two files"):
        folder = tmp_path / "ckpt"
        folder.mkdir()
        save(folder / "1.safetensors", ckpt)
        if case == "bad block size":
            (folder / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128]}}))
        else:
            save(folder / "2.safetensors", {a: ckpt[a]})
        return str(folder), None
    return save(tmp_path / "ckpt.safetensors", ckpt), masters


BAD = {
    "missing scales": r"missing scales: 'model.layers.0.self_attn.o_proj.weight' is float8_e4m3fn but the checkpoint "
                      r"has neither '.*o_proj.weight_scale_inv' nor '.*o_proj.weight_scale'",
    "bf16 weight with scales": r"ckpt.safetensors'.*'.*o_proj.weight' has scales '.*o_proj.weight_scale_inv' but its "
                               r"dtype is BF16, not float8_e4m3fn",
    "e5m2 weight with scales": r"'.*o_proj.weight' has scales .* dtype is F8_E5M2, not float8_e4m3fn",
    "scales of the wrong shape": r"scales '.*o_proj.weight_scale_inv' have shape \[1, 1\], which fits no layout of "
                                 r"'.*o_proj.weight' \[128, 256\]: blocks of 128x128 need \[1, 2\]",
    "both scale names": r"'.*o_proj.weight' has both '.*o_proj.weight_scale_inv' and '.*o_proj.weight_scale'",
    "3-D weight": r"'.*o_proj.weight' has shape \[2, 64, 256\]; only 2-D",
    "int scales": r"scales '.*o_proj.weight_scale_inv' have dtype I32",
    "no FP8 weight": r"ckpt.safetensors': no float8_e4m3fn weight with scales",
    "masters missing a tensor": r"masters '.*m.safetensors' lack 1 of the checkpoint's 2 FP8 weights: "
                                r"\['model.layers.0.self_attn.o_proj.weight'\]",
    "masters of another shape": r"m.safetensors'.*master '.*o_proj.weight' has shape \[256, 128\], the checkpoint's "
                                r"weight \[128, 256\]",
    "FP8 masters": r"master '.*o_proj.weight' has dtype torch.float8_e4m3fn",
    "no such path": r"checkpoint '.*nothing': no such file or folder",
    "empty folder": r"checkpoint '.*empty': the folder holds no \*.safetensors file",
    "not safetensors": r"checkpoint '.*junk.safetensors': not a readable safetensors file",
    "bad block size": r"config.json'.*weight_block_size must be two positive ints, got \[128\]",
    "a key in two files": r"checkpoint: tensor 'model.layers.0.mlp.down_proj.weight' is in both '.*1.safetensors' "
                          r"and '.*2.safetensors'",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_by_name(tmp_path, case, capsys):
    """Each bad input raises Fp8GridError naming the tensor, key or file; the console script exits 2 with it."""
    ckpt, masters = _bad(tmp_path, case)
    with pytest.raises(Fp8GridError, match=BAD[case]):
        report(ckpt, masters)
    with pytest.raises(SystemExit) as exit_:
        fp8_grid.main([ckpt] + (["--masters", masters] if masters else []))
    assert exit_.value.code == 2 and re.search("faircast-fp8-grid: error: .*" + BAD[case], capsys.readouterr().err)
