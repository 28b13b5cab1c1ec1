"""The FP8 E4M3 spec: the casts onto the E4M3 grid (faircast_dist.rounding) and the sticky scales
(faircast_dist.fp8). Exact bits where they are defined, statistics with stated tolerances."""
import pytest
import torch

from faircast_dist.fp8 import ScaleRule, element_scales, partial_absmax
from faircast_dist.philox import derive_dither_key, derive_key
from faircast_dist.rounding import (E4M3_MAX, cast_fp8_error_feedback, cast_fp8_nearest, cast_fp8_stochastic,
                                    e4m3_round)

G = torch.Generator().manual_seed(0)


def spread(n: int, lo: int = -14, hi: int = 10) -> torch.Tensor:
    """Signed fp32 values over the binades 2**lo .. 2**hi (E4M3 subnormals, normals and past 448)."""
    return (torch.rand(n, generator=G) * 2 - 1) * torch.exp2(torch.randint(lo, hi, (n,), generator=G).float())


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_nearest_is_torchs_saturating_cast_bit_for_bit():
    patterns = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=G, dtype=torch.int64).to(torch.int32)
    for y in (patterns.view(torch.float32), spread(1 << 18),
              torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 1e30, -1e30, 2**-9, 2**-10, 3 * 2**-11, 2**-6, 1.0625])):
        finite = torch.isfinite(y)
        ours = e4m3_round(y)
        assert torch.equal(bits(ours[finite]), bits(y[finite].clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)))
        assert torch.isnan(ours[~finite].float()).all()
    assert bits(e4m3_round(torch.tensor([-0.0]))).item() == 0x80  # -0 keeps its sign


def test_stochastic_lies_between_the_neighbours_and_bits_pick_which():
    y = spread(1 << 16)
    toward = e4m3_round(y, torch.zeros(y.shape, dtype=torch.int32)).float()
    away = e4m3_round(y, torch.full(y.shape, 65535, dtype=torch.int32)).float()
    q = e4m3_round(y, torch.randint(0, 65536, y.shape, generator=G, dtype=torch.int32)).float()
    yc = y.clamp(-E4M3_MAX, E4M3_MAX)
    # away is the upper neighbour, except where y sits less than 2**-16 of a spacing above the lower one
    assert ((toward.abs() <= yc.abs()) & ((yc.abs() <= away.abs()) | (away == toward))).all()
    assert (away != toward).float().mean() > 0.99
    assert ((q == toward) | (q == away)).all()
    grid = toward[toward.abs() < E4M3_MAX]  # values on the grid never move, whatever the bits
    for r in (0, 1, 40000, 65535):
        assert torch.equal(e4m3_round(grid, torch.full(grid.shape, r, dtype=torch.int32)).float(), grid)


@pytest.mark.parametrize("y", [1.0 + 2**-5, 0.3, -3.1e-3, 2**-9 * 0.37, 447.9, 5.0e-4])
def test_stochastic_is_unbiased_over_all_2_16_bits(y):
    """Over every 16-bit draw, the mean equals y with its fraction truncated to 16 bits of a spacing: within
    2**-16 spacing of y, exactly."""
    r = torch.arange(65536, dtype=torch.int32)
    x = torch.full((65536,), y, dtype=torch.float32)
    q = e4m3_round(x, r).double()
    lo = e4m3_round(x[:1], torch.zeros(1, dtype=torch.int32)).double()
    spacing = (e4m3_round(x[:1], torch.full((1,), 65535, dtype=torch.int32)).double() - lo).abs()
    frac16 = torch.floor((abs(float(x[0])) - lo.abs()) / spacing * 65536)
    assert q.mean().item() == pytest.approx((lo.abs() + frac16 / 65536 * spacing).item() * (1 if y > 0 else -1),
                                            abs=0, rel=1e-15)
    assert abs(q.mean().item() - float(x[0])) <= spacing.item() * 2**-16


def test_scales_fit_the_maximum_and_are_the_smallest_of_their_kind():
    a = torch.cat([spread(1 << 16, -40, 40).abs(), torch.tensor([0.0, 448.0, 1.0, 2.0**-130])])
    for ue8m0 in (False, True):
        s = ScaleRule(ue8m0=ue8m0).scales(a)
        assert (a / s <= E4M3_MAX).all() and (s >= 2.0**-126).all()
        big = a > E4M3_MAX * 2.0**-126
        if ue8m0:
            assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two
            assert (a[big] / (s[big] / 2) > E4M3_MAX).all()  # half the scale would not fit
        else:
            smaller = torch.nextafter(s, torch.zeros_like(s))
            assert (a[big] / smaller[big] > E4M3_MAX).all()
    # the maximum lands at (or one FP8 step under) 448 with round-to-nearest
    s = ScaleRule().scales(a[big := a > 1e-30])
    assert (e4m3_round(a[big] / s).float() >= 416).all()


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_sticky_scales_change_only_where_an_element_no_longer_fits(granularity):
    layout, shape = ScaleRule(granularity), (300, 200)  # blocks of 128 that the edges cut
    master = torch.randn(shape, generator=G)
    sidx = layout.scale_index(shape, 0, master.numel()).reshape(shape)
    n = torch.Size(layout.scale_shape(shape)).numel()
    s0, _, first = layout.next_scales(None, partial_absmax(master, sidx, n))
    assert first.all() and s0.shape == (n,)
    # an update that keeps every element within its scale: nothing rescaled, same scales
    moved = master * 0.999
    s1, _, re1 = layout.next_scales(s0, partial_absmax(moved, sidx, n))
    assert not re1.any() and torch.equal(s1, s0)
    # one element past 448 of its scale: its channel or block alone is set again
    grown = master.clone()
    grown[250, 150] = 1000.0
    s2, _, re2 = layout.next_scales(s0, partial_absmax(grown, sidx, n))
    want = 250 if granularity == "channel" else (250 // 128) * 2 + 150 // 128
    assert re2.nonzero().flatten().tolist() == [want]
    assert torch.equal(s2[re2 == 0], s0[re2 == 0]) and s2[want] > s0[want]
    q = cast_fp8_nearest(grown, element_scales(s2, sidx))
    assert (q.float().abs() <= E4M3_MAX).all() and not torch.isnan(q.float()).any()


def test_a_kept_scale_that_is_no_scale_is_set_again():
    """A NaN, Inf, zero or negative scale (a corrupt checkpoint's) would serve NaN or nonsense for good."""
    bad = torch.tensor([float("nan"), float("inf"), 0.0, -1.0, 0.0, 1.0])
    absmax = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    for ue8m0 in (False, True):
        layout = ScaleRule(ue8m0=ue8m0)
        scales, _, rescaled = layout.next_scales(bad, absmax)
        assert rescaled.tolist() == [True] * 5 + [False]
        assert torch.equal(scales[:5], layout.scales(absmax[:5])) and scales[5] == 1.0
    assert torch.isnan(ScaleRule(ue8m0=True).scales(torch.tensor([float("nan")]))).all()


def test_finite_masters_saturate_and_never_serve_nan():
    """A quotient that overflows (a tiny scale) serves ±448; error feedback on masters near fp32 max keeps q and the
    residual finite."""
    q = cast_fp8_nearest(torch.tensor([1e10, -1.0]), torch.tensor([1e-30, 1e-45]))
    assert q.float().tolist() == [448.0, -448.0]
    q = cast_fp8_stochastic(torch.tensor([1e10]), torch.tensor([1e-30]), derive_key(0, 0, "w"), 0)
    assert q.float().tolist() == [448.0]
    residual = torch.tensor([1e38])
    for _ in range(2):
        q = cast_fp8_error_feedback(torch.tensor([3e38]), torch.tensor([3e38 / 448]), residual)
        assert torch.isfinite(q.float()).all() and torch.isfinite(residual).all()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_non_finite_master_serves_nan_with_its_sign(backend):
    """What the export does with a diverged master: FP8 serves NaN with the master's sign (0x7f, 0xff; E4M3 has no
    Inf, and ±448 would pass for a weight) in every method, as bf16 keeps NaN and ±Inf; the residual is left alone.
    The receiver refuses to serve either by default (docs/vllm.md)."""
    from faircast_dist import fused
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0])
    for method in ("nearest", "stochastic", "error_feedback"):
        out, residual = torch.zeros(5, dtype=torch.uint8), torch.tensor([0.25] * 4 + [0.0])
        fused.cast_fp8(method, [x], [out], [(0, 0, 5, 0, 1, 2, 0, 1, 0)], torch.ones(5),
                       [residual] if method == "error_feedback" else None, backend=backend)
        assert out.tolist() == [0x7F, 0xFF, 0x7F, 0xFF, 0x80], method
        assert residual.tolist()[:4] == [0.25] * 4


def test_absmax_skips_non_finite_elements():
    y = torch.tensor([[1.0, float("nan"), -3.0], [float("inf"), -2.0, 0.5]])
    assert partial_absmax(y, ScaleRule().scale_index((2, 3), 0, 6).reshape(2, 3), 2).tolist() == [3.0, 2.0]


def test_scale_layouts_match_vllms_shapes_and_names():
    assert ScaleRule("channel").scale_shape((300, 200)) == (300, 1)
    assert ScaleRule("block").scale_shape((300, 200)) == (3, 2)
    assert (ScaleRule("channel").scale_name, ScaleRule("block").scale_name) == ("weight_scale", "weight_scale_inv")
    idx = ScaleRule("block").scale_index((300, 200), torch.tensor([0, 127, 128, 199, 128 * 200, 299 * 200 + 199]))
    assert idx.tolist() == [0, 0, 1, 1, 2, 5]


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_shards_give_the_whole_tensors_scales_and_bytes(granularity):
    """Any split of the flat elements (mid-row, mid-block starts, strided): partial absmax MAX-reduced, and the
    stochastic cast keyed on global indices, equal the single-process export bit for bit."""
    layout, shape = ScaleRule(granularity), (300, 200)
    master = torch.randn(shape, generator=G) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=G).float())
    flat = master.reshape(-1)
    n = torch.Size(layout.scale_shape(shape)).numel()
    whole_idx = layout.scale_index(shape, 0, flat.numel())
    scales, _, _ = layout.next_scales(None, partial_absmax(flat, whole_idx, n))
    key = derive_key(3, 7, "w")
    whole = cast_fp8_stochastic(flat, element_scales(scales, whole_idx), key, 0)
    cuts = [0, 1, 12345, 25600 + 77, 40000, flat.numel()]
    shards = [torch.arange(a, b) for a, b in zip(cuts, cuts[1:])] + [torch.arange(5, flat.numel(), 3)]
    reduced = torch.zeros(n)
    for g in shards[:-1]:
        reduced = torch.maximum(reduced, partial_absmax(flat[g], layout.scale_index(shape, g), n))
    assert torch.equal(layout.scales(reduced), scales)
    for g in shards:
        part = cast_fp8_stochastic(flat[g], element_scales(scales, layout.scale_index(shape, g)), key, g)
        assert torch.equal(bits(part), bits(whole[g]))


def two_exports(state, masters: dict):
    """Export ``masters`` twice through ``state`` (an FP8 ExportState), each cut mid-row into three shards, the
    second time after a small update (the scales are kept where everything fits): yields ``(step, full FP8
    tensors, {name: whole master exported})``."""
    from faircast_dist.export import Shard
    shards = []
    for name, m in masters.items():
        flat, cuts = m.reshape(-1), [0, m.numel() // 3 + 7, 2 * m.numel() // 3 + 1, m.numel()]
        shards += [Shard((name, a), flat[a:b].clone(), torch.zeros(b - a, dtype=torch.bfloat16), [(name, 0, b - a, a)])
                   for a, b in zip(cuts, cuts[1:])]
    for step in range(2):
        if step:
            for s in shards:
                s.master.mul_(1 + 2 ** -12)
        state.caster.step = step
        state.export_fp8(shards)
        yield step, state.full_fp8(shards), {n: torch.cat([s.master for s in shards if s.key[0] == n]).view(
            masters[n].shape) for n in masters}


@pytest.mark.parametrize("method", ["dithered", "error_feedback"])
def test_a_fused_param_takes_the_blocks_of_its_checkpoint_tensors(method):
    """Block scales on a fused param (Megatron's linear_qkv: 2 query groups of 3 heads of 48; SwiGLU fc1 of 150):
    its bytes and scales are those of the zero-padded stack of its q/k/v (gate/up) tensors cast as one param, served
    back in its own row order, whatever shards (mid-row cuts) hold it. Without the padding, q_proj's last block
    (32 rows) and k_proj's (96) would share a scale."""
    from faircast_dist import FairCaster
    from faircast_dist.export import ExportState
    from faircast_dist.fp8 import FusedRows
    from helpers import checkpoint_parts, reference_fp8_fused
    groups, q, d, k = 2, 3, 48, 200
    qkv = FusedRows([pc for g in range(groups) for pc in ((0, g * q * d, q * d), (1, g * d, d), (2, g * d, d))])
    fc1 = FusedRows([(0, 0, 150), (1, 0, 150)])
    config = {"mode": "fair", "method": method, "seed": 5, "format": "fp8", "fp8_scales": "block"}
    names = {"l.self_attention.linear_qkv.weight": qkv, "l.mlp.linear_fc1.weight": fc1, "l.mlp.linear_fc2.weight": None}
    masters = {n: torch.randn(f.rows if f else 150, k, generator=G) * torch.exp2(
        torch.randint(-6, 6, (f.rows if f else 150, 1), generator=G).float()) for n, f in names.items()}
    assert [len(checkpoint_parts(n, m, groups, groups * q) or []) for n, m in masters.items()] == [3, 2, 0]
    state = ExportState(FairCaster(config), shapes={n: m.shape for n, m in masters.items()},
                        fused={n: f for n, f in names.items() if f})
    snaps = []
    for step, full, now in two_exports(state, masters):
        snaps.append({"step": step, "masters": now})
        want = reference_fp8_fused(config, snaps, groups, groups * q)[-1]
        for name, f in names.items():
            assert torch.equal(bits(full[name]), bits(want[name])), (name, step)
            assert torch.equal(state.fp8.scales[name], want[name[:-len("weight")] + "weight_scale_inv"]), (name, step)
    assert state.fp8.scales["l.self_attention.linear_qkv.weight"].shape == (3 + 1 + 1, 2)
    assert state.fp8.scales["l.mlp.linear_fc1.weight"].shape == (2 + 2, 2)


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("method", ["nearest", "error_feedback"])
def test_fused_experts_are_served_as_their_checkpoint_tensors_in_fp8(granularity, method):
    """transformers 5's fused experts (Qwen3-MoE: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; I = 150, so a
    128-row block of gate rows would reach into the up rows) serve FP8 bytes and scales that are, expert by expert,
    those of the per-expert checkpoint tensors (``experts.e.gate_proj.weight``, ``up_proj``, ``down_proj``) cast as
    2-D weights of their own, whatever shards (mid-row cuts) hold them; the scales sit beside them as transformers 5
    names an FP8 model's (``gate_up_proj_scale_inv`` [E, 2 ceil(I/128), ceil(H/128)]). GPT-OSS's transposed experts
    stay bf16."""
    import transformers
    from faircast_dist import FairCaster
    from faircast_dist.export import ExportState
    from faircast_dist.fp8 import fused_experts
    from helpers import expert_checkpoint, reference_fp8, tiny_moe
    model = tiny_moe(intermediate=150, hidden=200, experts=3)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    fused = fused_experts(model, shapes)
    assert sorted(fused) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    config = {"mode": "fair", "method": method, "seed": 5, "format": "fp8", "fp8_scales": granularity} \
        if method != "nearest" else {"mode": "nearest", "format": "fp8", "fp8_scales": granularity}
    state = ExportState(FairCaster(config), shapes=shapes, fused=fused)
    masters = {n: torch.randn(shapes[n], generator=G) * torch.exp2(torch.randint(-6, 6, (*shapes[n][:-1], 1),
                                                                                  generator=G).float())
               for n in fused}
    snaps, suffix = [], "_scale_inv" if granularity == "block" else "_scale"
    for step, full, now in two_exports(state, masters):
        served = dict(state.fp8.served([(n, None) for n in masters], full))
        snaps.append({"step": step, "masters": expert_checkpoint(now)})
        want = reference_fp8(config, snaps)[-1]
        assert [(served[n].shape, served[n].dtype) for n in masters] == \
            [(shapes[n], torch.float8_e4m3fn) for n in masters]
        assert sorted(served) == sorted([*masters, *(n + suffix for n in masters)])
        got = expert_checkpoint(served)
        assert got.keys() == want.keys()
        assert all(torch.equal(bits(got[t]), bits(want[t])) for t in got), step
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2))
    assert fused_experts(gpt_oss, {n: tuple(p.shape) for n, p in gpt_oss.named_parameters()}) == {}


def test_stochastic_and_dithered_are_unbiased_in_the_served_weight():
    """Mean over 4000 exports of q * s vs the master, per element: within 5 standard errors of a Bernoulli over
    one spacing (sd <= spacing / 2)."""
    layout, shape = ScaleRule(), (4, 64)
    master = torch.randn(shape, generator=G)
    sidx = layout.scale_index(shape, 0, master.numel()).reshape(shape)
    s = element_scales(layout.next_scales(None, partial_absmax(master, sidx, 4))[0], sidx)
    steps = 4000
    total = torch.zeros(shape, dtype=torch.float64)
    for step in range(steps):
        total += cast_fp8_stochastic(master, s, derive_key(0, step, "w"), 0).double() * s
    spacing = (e4m3_round(master / s, torch.full(shape, 65535, dtype=torch.int32)).double()
               - e4m3_round(master / s, torch.zeros(shape, dtype=torch.int32)).double()).abs() * s
    assert ((total / steps - master).abs() <= 5 * spacing / 2 / steps**0.5 + 1e-7).all()
    near = cast_fp8_nearest(master, s).double() * s
    assert ((near - master).abs() > 0.2 * spacing).any()  # the test could tell a biased cast apart
    # dithered: the same bits at every export for an unchanged master
    d = derive_dither_key(0, "w")
    assert torch.equal(bits(cast_fp8_stochastic(master, s, d, 0)), bits(cast_fp8_stochastic(master, s, d, 0)))


def test_error_feedback_loses_no_update_that_nearest_drops():
    """Masters on the grid (scale 0.5: spacing 0.25 in [2, 4)) moved by 0.01 per step for 10 steps: round-to-
    nearest serves the start all along (every update dropped); error feedback's served weights add up to the
    masters' within half a spacing (sum(q * s - master) = -residual), and the residual is y - q * s as defined."""
    shape = (8, 32)
    start = 2 + 0.25 * torch.randint(0, 8, shape, generator=G).float()
    s, m, residual = torch.full(shape, 0.5), start.clone(), torch.zeros(shape)
    ef_total, moved = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    for _ in range(10):
        m += 0.01
        y = m + residual
        q = cast_fp8_error_feedback(m, s, residual)
        assert torch.equal(residual, y - q.float() * s)
        assert torch.equal(cast_fp8_nearest(m, s).float() * s, start)
        ef_total += q.float() * s - m
        moved |= q.float() * s != start
    assert (ef_total.abs() <= 0.125 + 1e-5).all() and moved.all()


def test_error_feedback_non_finite_master_keeps_its_residual():
    master = torch.tensor([1.0, float("nan"), float("inf"), -0.0])
    residual = torch.tensor([0.01, 0.02, 0.03, 0.0])
    q = cast_fp8_error_feedback(master, torch.ones(4), residual)
    assert torch.isnan(q.float()[1:3]).all() and residual[1:3].tolist() == pytest.approx([0.02, 0.03])
    assert bits(q)[3].item() == 0x80 and residual[3].item() == 0.0


def test_double_rounding_through_bf16_is_a_different_cast():
    layout, shape = ScaleRule(), (64, 64)
    master = torch.randn(shape, generator=G)
    sidx = layout.scale_index(shape, 0, master.numel()).reshape(shape)
    s = element_scales(layout.next_scales(None, partial_absmax(master, sidx, 64))[0], sidx)
    direct, twice = cast_fp8_nearest(master, s), cast_fp8_nearest(master, s, via_bf16=True)
    assert 0 < (bits(direct) != bits(twice)).sum() < master.numel() // 50


def test_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        ScaleRule("row")
    with pytest.raises(ValueError, match="2-D"):
        ScaleRule().scale_shape((4, 4, 4))
    with pytest.raises(ValueError, match="scale must be float32 shaped like"):
        cast_fp8_nearest(torch.ones(4, 4), torch.ones(4, 1))
    with pytest.raises(TypeError, match="float32"):
        cast_fp8_nearest(torch.ones(4, dtype=torch.bfloat16), torch.ones(4))
    with pytest.raises(ValueError, match="residual"):
        cast_fp8_error_feedback(torch.ones(4), torch.ones(4), torch.zeros(4, dtype=torch.bfloat16))
    from faircast_dist import FairCaster
    from faircast_dist.fp8 import Fp8Export, FusedRows
    with pytest.raises(ValueError, match=r"pieces of part 0 do not tile its rows once: \[\(0, 4\), \(5, 3\)\]"):
        FusedRows([(0, 0, 4), (0, 5, 3)])
    with pytest.raises(ValueError, match="pieces of part 1"):
        FusedRows([(0, 0, 4), (2, 0, 4)])
    with pytest.raises(ValueError, match="'w.weight' has 9 rows, its fused checkpoint tensors \\[4, 4\\] \\(8\\)"):
        Fp8Export(FairCaster({"mode": "nearest", "format": "fp8", "fp8_scales": "block"}), {"w.weight": (9, 3)},
                  {"w.weight": FusedRows([(0, 0, 4), (1, 0, 4)])})


def test_loaded_scales_of_another_kind_or_params_are_refused_by_name():
    """Scales are sticky: a checkpoint's non-power-of-two scales loaded under fp8_ue8m0 would stay for good, and a
    checkpoint saved with another fp8_exclude lacks some params' scales: both are errors naming them."""
    from faircast_dist import FairCaster
    from faircast_dist.fp8 import Fp8Export
    shapes = {"a.weight": (2, 3), "b.weight": (4, 3)}
    ue8m0 = Fp8Export(FairCaster({"mode": "nearest", "format": "fp8", "fp8_ue8m0": True}), shapes)
    ue8m0.load_scales({"a.weight": torch.tensor([[0.5], [0.25]]), "b.weight": torch.full((4, 1), 2.0 ** -7)})
    with pytest.raises(ValueError, match="scales of 'a.weight' are not powers of two but fp8_ue8m0"):
        ue8m0.load_scales({"a.weight": torch.tensor([[0.5], [0.3]]), "b.weight": torch.ones(4, 1)})
    plain = Fp8Export(FairCaster({"mode": "nearest", "format": "fp8"}), shapes)
    with pytest.raises(ValueError, match=r"no scales for \['b.weight'\] .*add an fp8_exclude pattern that keeps them"):
        plain.load_scales({"a.weight": torch.ones(2, 1)})
    with pytest.raises(ValueError, match="saved scales of 'a.weight' have shape"):
        plain.load_scales({"a.weight": torch.ones(1, 1), "b.weight": torch.ones(4, 1)})
