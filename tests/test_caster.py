"""FairCaster (config + step), the config and the drift telemetry."""
import math

import pytest
import torch

from faircast_dist import ExportCastConfig, FairCaster, derive_key
from faircast_dist.philox import derive_dither_key
from faircast_dist.config import ConfigError
from faircast_dist.rounding import cast_stochastic
from faircast_dist.telemetry import LagTracker, bf16_spacing, changed_fraction, gap_ulps, logprob_gap


def test_a_section_without_mode_is_an_error_not_a_silent_stock_run():
    with pytest.raises(ValueError, match='has no "mode": give "mode": "fair"') as err:
        ExportCastConfig.from_value({"method": "error_feedback"})
    assert err.value.field == "mode"
    assert ExportCastConfig.from_value({}) == ExportCastConfig()  # nothing asked: stock


def test_config_parsing_and_errors():
    assert ExportCastConfig.from_value(None).effective_method == "nearest"
    assert ExportCastConfig.from_value("fair").effective_method == "stochastic"
    cfg = ExportCastConfig.from_value({"mode": "fair", "method": "error-feedback", "seed": 3})
    assert cfg.method == "error_feedback" and cfg.seed == 3 and cfg.enabled
    assert ExportCastConfig.from_value({"mode": "nearest", "method": "error_feedback"}).effective_method == "nearest"
    assert ExportCastConfig.from_value({"mode": "fair", "method": "dithered"}).effective_method == "dithered"
    with pytest.raises(ValueError, match=r"unknown key\(s\) in export_cast: \['sed'\]"):
        ExportCastConfig.from_value({"mode": "fair", "sed": 1})
    with pytest.raises(ValueError, match="export_cast.method must be one of .* got 'sr'"):
        ExportCastConfig.from_value({"mode": "fair", "method": "sr"})
    with pytest.raises(ValueError, match="export_cast.seed"):
        ExportCastConfig(mode="fair", seed=True)
    with pytest.raises(ValueError, match="export_cast.residual_dtype"):
        ExportCastConfig(mode="fair", residual_dtype="float16")
    with pytest.raises(TypeError, match="export_cast must be a mode string or a dict"):
        ExportCastConfig.from_value(["fair"])
    with pytest.raises(ValueError, match=r"export_cast.residual_dtype must be one of .* got \['float32'\]"):
        ExportCastConfig.from_value({"mode": "fair", "residual_dtype": ["float32"]})
    with pytest.raises(ValueError, match="export_cast.method must be one of .* got None"):
        ExportCastConfig.from_value({"mode": "fair", "method": None})


def test_fp8_format_settings_are_checked_and_named():
    """format "fp8": installs even with mode "nearest" (the stacks' FP8 rounding is a baseline worth serving);
    every FP8 key's bad value, or an FP8 key without format "fp8", is an error naming it."""
    fp8 = ExportCastConfig.from_value({"mode": "nearest", "format": "fp8"})
    assert fp8.enabled and fp8.fp8 and fp8.effective_method == "nearest"
    assert not ExportCastConfig.from_value({"mode": "nearest"}).enabled
    bad = [({"mode": "fair", "format": "fp16"}, "format", "export_cast.format must be one of"),
           ({"mode": "fair", "format": "fp8", "fp8_scales": "tensor"}, "fp8_scales", "fp8_scales must be one of"),
           ({"mode": "fair", "format": "fp8", "fp8_ue8m0": 1}, "fp8_ue8m0", "must be true or false"),
           ({"mode": "fair", "format": "fp8", "fp8_exclude": "(lm_head"}, "fp8_exclude", "regular expression"),
           ({"mode": "fair", "fp8_scales": "block"}, "fp8_scales", "set but format is 'bf16'"),
           ({"mode": "fair", "format": "fp8", "fp8_via_bf16": True}, "fp8_via_bf16", "round-to-nearest")]
    for value, field, match in bad:
        with pytest.raises(ConfigError, match=match) as err:
            ExportCastConfig.from_value(value)
        assert err.value.field == field
    from faircast_dist.fp8 import fp8_param
    names = {"model.layers.0.self_attn.q_proj.weight": True, "model.layers.0.mlp.down_proj.weight": True,
             "model.embed_tokens.weight": False, "lm_head.weight": False, "model.norm.weight": False,
             "model.layers.0.mlp.gate.weight": False, "model.layers.0.mlp.gate_proj.weight": True,
             "decoder.layers.0.self_attention.linear_qkv.weight": True, "output_layer.weight": False,
             "decoder.layers.0.mlp.router.weight": False, "model.layers.0.self_attn.q_proj.bias": False,
             "model.layers.0.mlp.shared_expert_gate.weight": False,
             "decoder.layers.0.mlp.shared_experts.gate_weight": False,
             "decoder.layers.0.mlp.experts.experts.3.linear_fc1.weight": True,
             "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": True}
    assert {n: fp8_param(fp8, n, (8, 8) if n.endswith("weight") else (8,)) for n in names} == names
    assert not fp8_param(fp8, "model.layers.0.mlp.experts.gate_up_proj", (4, 8, 8))  # 3-D: by fused_experts only
    everything = ExportCastConfig.from_value({"mode": "nearest", "format": "fp8", "fp8_exclude": ""})
    assert fp8_param(everything, "lm_head.weight", (8, 8))


def test_caster_steps_key_the_bits():
    x = torch.randn(5000)
    c = FairCaster({"mode": "fair", "seed": 11})
    a = c.cast("w", x)
    assert torch.equal(a, cast_stochastic(x, derive_key(11, 0, "w"), 0))
    c.advance()
    b = c.cast("w", x)
    assert torch.equal(b, cast_stochastic(x, derive_key(11, 1, "w"), 0))
    assert not torch.equal(a, b)
    assert not torch.equal(b, c.cast("v", x))  # the name keys the bits too


def test_cast_tensors_at_an_earlier_step_recasts_that_exports_bits():
    x = torch.randn(5000)
    c = FairCaster({"mode": "fair", "seed": 11})
    first = c.cast_tensors([x], [torch.empty(5000, dtype=torch.bfloat16)], [(0, "w", 0, 5000, 0)])[0]
    c.advance()
    again = c.cast_tensors([x], [torch.empty(5000, dtype=torch.bfloat16)], [(0, "w", 0, 5000, 0)], step=0)[0]
    assert c.step == 1 and torch.equal(first.view(torch.int16), again.view(torch.int16))
    assert torch.equal(again, cast_stochastic(x, derive_key(11, 0, "w"), 0))
    assert c.key("w", 0) == derive_key(11, 0, "w") != c.key("w")


def test_dithered_caster_uses_the_stepless_dither_key():
    x = torch.randn(5000)
    c = FairCaster({"mode": "fair", "method": "dithered", "seed": 11})
    assert c.method == "dithered" and c.key("w") == derive_dither_key(11, "w")
    for _ in range(3):  # the same bits at every step: the cast of stochastic rounding with that key
        assert torch.equal(c.cast("w", x), cast_stochastic(x, derive_dither_key(11, "w"), 0))
        c.advance()
    for config in (None, {"mode": "fair", "method": "error_feedback"}):
        with pytest.raises(ValueError, match="draws no random bits"):
            FairCaster(config).key("w")


def test_caster_nearest_is_stock():
    x = torch.randn(1000)
    assert torch.equal(FairCaster(None).cast("w", x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_error_feedback_needs_the_shards_residual():
    with pytest.raises(ValueError, match="error feedback needs the shard's residual"):
        FairCaster({"mode": "fair", "method": "error_feedback"}).cast("w", torch.randn(10))


def test_changed_fraction_and_gap_ulps():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.bfloat16)
    b = a.clone()
    b[1] = 2.015625
    assert changed_fraction(a, b) == 0.25
    x = torch.randn(100_000)
    assert gap_ulps(x.to(torch.bfloat16), x) <= 0.5  # RTN is within half an ulp
    assert 0.2 < gap_ulps(x.to(torch.bfloat16), x) < 0.3  # ~0.25 for uniform fractional parts
    with pytest.raises(TypeError):
        changed_fraction(a.float(), b)


def test_bf16_spacing():
    x = torch.tensor([1.0, 1.5, 2.0, -0.75, 2.0**-133, 0.0, float(torch.finfo(torch.bfloat16).max), math.inf])
    s = bf16_spacing(x)
    assert s[:7].tolist() == [2**-7, 2**-7, 2**-6, 2**-8, 2**-133, 2**-133, 2.0**120]
    assert math.isnan(s[7])


def test_lag_tracker_finds_the_lag():
    tracker = LagTracker(numel=1000, sample_size=200, max_lag=10, seed=0)
    g = torch.Generator().manual_seed(1)
    masters = [torch.randn(1000, generator=g)]
    for _ in range(12):
        masters.append(masters[-1] + 0.01 * torch.randn(1000, generator=g))
    lags = []
    for t, m in enumerate(masters):
        served = masters[max(t - 3, 0)]  # a server three steps behind
        lags.append(tracker.update(m[tracker.index], served[tracker.index]))
    assert lags[:4] == [0, 1, 2, 3] and all(lag == 3 for lag in lags[4:])


def test_logprob_gap():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    assert logprob_gap(logits, logits, targets) == (0.0, 0.0)
    shifted = logits.clone()
    shifted[..., 0] += 1.0
    gap, kl = logprob_gap(logits, shifted, targets)
    assert gap > 0 and kl > 0


# -- on-device drift telemetry (DriftSample) ------------------------------------------------------
def test_sample_stride_is_a_prime_giving_about_the_sample():
    from faircast_dist.telemetry import sample_stride
    assert sample_stride(0) == sample_stride(65536) == 1
    for total, sample in [(10**6, 1000), (1_700_000_000, 65536), (12345, 7)]:
        n = sample_stride(total, sample)
        assert n >= total / sample and all(n % d for d in range(2, int(n ** 0.5) + 1))
        assert total / n > sample / 2
    with pytest.raises(ValueError, match="sample"):
        sample_stride(10, 0)


def test_sampled_positions_do_not_depend_on_the_sharding():
    """Shards of a param, in any order and buffer offset, sample exactly the whole param's elements."""
    from faircast_dist.telemetry import sampled_positions
    g = torch.Generator().manual_seed(0)
    for stride in (1, 2, 7, 31):
        whole = set(sampled_positions([("p", 0, 1000, 0)], stride).tolist())
        assert abs(len(whole) - 1000 / stride) <= 1
        cuts = sorted(torch.randint(1, 1000, (5,), generator=g).tolist())
        rows, offset = [], 500  # shards packed into one buffer from position 500, last shard first
        for lo, hi in reversed(list(zip([0] + cuts, cuts + [1000]))):
            rows.append(("p", offset, hi - lo, lo))
            offset += hi - lo
        got = set()
        for name, start, numel, index in rows:
            pos = sampled_positions([(name, start, numel, index)], stride)
            assert bool(((pos >= start) & (pos < start + numel)).all())
            got |= set((pos - start + index).tolist())
        assert got == whole
    other = set(sampled_positions([("q", 0, 1000, 0)], 31).tolist())
    assert other != set(sampled_positions([("p", 0, 1000, 0)], 31).tolist())  # the phase depends on the name


def test_drift_sample_measures_changed_fraction_gap_and_lag():
    from faircast_dist.telemetry import DriftSample, reduce_drift
    g = torch.Generator().manual_seed(1)
    masters = [torch.randn(3000, generator=g)]
    for _ in range(8):
        masters.append(masters[-1] + 0.01 * torch.randn(3000, generator=g))
    rows = [("a", 0, 1000, 0), ("b", 1000, 2000, 0)]
    drift = DriftSample(stride=1, max_lag=5)
    for t, m in enumerate(masters):
        served = masters[max(t - 2, 0)].to(torch.bfloat16)  # two exports behind
        drift.observe([("buf", m, served, rows)])
        got = reduce_drift([drift], export_ms=3.0)
        assert got["lag_steps"] == min(t, 2) and got["export_ms"] == 3.0
        assert got["gap_ulps"] == pytest.approx(gap_ulps(served, m), rel=1e-6)
        want = changed_fraction(masters[max(t - 3, 0)].to(torch.bfloat16), served) if t else 0.0
        assert got["changed_fraction"] == pytest.approx(want, rel=1e-6)  # float32 mean there
    nan = masters[-1].clone()
    nan[:10] = float("nan")
    drift.observe([("buf", nan, nan.to(torch.bfloat16), rows)])  # non-finite masters are left out of gap and lag
    got = reduce_drift([drift])
    assert got["lag_steps"] == 0 and got["gap_ulps"] == pytest.approx(gap_ulps(nan.to(torch.bfloat16), nan), rel=1e-6)


def test_fp8_drift_sample_measures_the_served_fp8_copy():
    """With an Fp8Export the sample measures q * scale: changed E4M3 bytes, the lag, and the gap in E4M3 spacings
    times the scale, against a plain computation on the whole tensors (spacing from frexp)."""
    from faircast_dist import ExportCastConfig, FairCaster
    from faircast_dist.fp8 import Fp8Export, element_scales
    from faircast_dist.rounding import cast_fp8_nearest
    from faircast_dist.telemetry import DriftSample, reduce_drift
    g = torch.Generator().manual_seed(2)
    shapes = {"a.weight": (10, 100), "b.weight": (20, 100)}
    fp8 = Fp8Export(FairCaster(ExportCastConfig.from_value({"mode": "fair", "format": "fp8"})), shapes)
    fp8.scales = {n: torch.rand(shape[0], 1, generator=g) * 0.01 + 0.001 for n, shape in shapes.items()}
    scale = torch.cat([element_scales(fp8.scales[n], fp8.rule.scale_index(shape, 0, shape[0] * shape[1]))
                       for n, shape in shapes.items()])
    masters = [torch.randn(3000, generator=g)]
    masters[0][:50] *= 1e-4  # the subnormal grid of E4M3
    for _ in range(8):
        masters.append(masters[-1] + 0.05 * torch.randn(3000, generator=g))
    rows = [("a.weight", 0, 1000, 0), ("b.weight", 1000, 2000, 0)]
    drift = DriftSample(stride=1, max_lag=5, fp8=fp8)
    served = [cast_fp8_nearest(m, scale) for m in masters]
    for t, m in enumerate(masters):
        q = served[max(t - 2, 0)]  # two exports behind
        drift.observe([("buf", m, q.view(torch.uint8), rows)])
        got = reduce_drift([drift])
        y = torch.clamp((m / scale).abs(), max=448)
        spacing = torch.ldexp(torch.ones(3000), torch.clamp(torch.frexp(y).exponent - 1, min=-6) - 3) * scale
        assert got["gap_ulps"] == pytest.approx(((q.float() * scale - m).abs() / spacing).mean().item(), rel=1e-6)
        assert got["lag_steps"] == min(t, 2)
        before = served[max(t - 3, 0)].view(torch.uint8)
        want = (before != q.view(torch.uint8)).float().mean().item() if t else 0.0
        assert got["changed_fraction"] == pytest.approx(want, rel=1e-6)
    assert got["gap_ulps"] > 1  # two exports behind
    from faircast_dist.telemetry import DriftObserver
    observer = DriftObserver(stride=1, max_lag=5)  # fp8() without fp8_begin() first: measures, no AttributeError
    observer.fp8(fp8, lambda: [("buf", masters[0], served[0].view(torch.uint8), rows)])
    assert observer.fp8_sample.last is not None


def test_drift_sample_primed_resume_reports_what_the_uninterrupted_run_does():
    """A run resumed at export 4 (a fresh DriftSample primed with the served model it loaded)
    reports the same changed_fraction and gap_ulps as the uninterrupted run; primed at the start,
    the first export counts the change from the initial model, not 0."""
    from faircast_dist.telemetry import DriftSample, reduce_drift
    g = torch.Generator().manual_seed(2)
    masters = [torch.randn(2000, generator=g)]
    for _ in range(7):
        masters.append(masters[-1] + 0.02 * torch.randn(2000, generator=g))
    initial = (masters[0] + 0.05).to(torch.bfloat16)
    served = [m.to(torch.bfloat16) for m in masters]
    rows = [("w", 0, 2000, 0)]
    straight, resumed = DriftSample(stride=7, max_lag=3), DriftSample(stride=7, max_lag=3)
    straight.prime([("buf", masters[0], initial, rows)])
    for t, m in enumerate(masters):
        straight.observe([("buf", m, served[t], rows)])
        want = reduce_drift([straight])
        if t == 0:
            every = DriftSample(stride=1)
            every.prime([("buf", m, initial, rows)])
            every.observe([("buf", m, served[0], rows)])
            assert reduce_drift([every])["changed_fraction"] == pytest.approx(changed_fraction(initial, served[0]))
            assert want["changed_fraction"] > 0
        if t == 4:
            resumed.prime([("buf", m, served[3], rows)])  # the served model the checkpoint holds
        if t >= 4:
            resumed.observe([("buf", m, served[t], rows)])
            got = reduce_drift([resumed])
            assert got["changed_fraction"] == want["changed_fraction"] and got["gap_ulps"] == want["gap_ulps"]


def test_export_timer_counts_only_its_spans():
    """ZeRO casts each group right after stepping it: the step between two casts is not export time."""
    import time
    from faircast_dist.telemetry import ExportTimer
    timer = ExportTimer()
    assert timer.ms() == 0.0
    timer.start("cpu")
    time.sleep(0.05)
    timer.stop()
    time.sleep(0.4)  # the next group's optimizer step
    timer.start("cpu", new=False)
    time.sleep(0.05)
    timer.stop()
    timer.stop()  # closed already: no change
    assert 100 <= timer.ms() < 400
    timer.start("cpu")  # the next export
    timer.stop()
    assert timer.ms() < 50


def test_reduce_drift_refuses_samples_that_have_not_observed():
    from faircast_dist.telemetry import DriftSample, reduce_drift
    with pytest.raises(ValueError, match="observed"):
        reduce_drift([DriftSample(1)])
    a, b = DriftSample(1, max_lag=3), DriftSample(1, max_lag=4)
    for s in (a, b):
        s.observe([], device="cpu")
    with pytest.raises(ValueError, match="disagree"):
        reduce_drift([a, b])


def test_drift_sample_reset_forgets_the_served_model_and_the_history():
    """After a checkpoint load mid-run the integrations reset the sample: the next export is
    primed from the loaded model and the lag history restarts."""
    from faircast_dist.telemetry import DriftSample, reduce_drift
    g = torch.Generator().manual_seed(2)
    rows = [("w", 0, 2000, 0)]
    drift = DriftSample(stride=1, max_lag=4)
    old = [torch.randn(2000, generator=g) for _ in range(3)]
    for m in old:
        drift.observe([("w", m, m.to(torch.bfloat16), rows)])
    loaded = torch.randn(2000, generator=g)  # a checkpoint of another run
    drift.reset()
    drift.prime([("w", loaded, loaded.to(torch.bfloat16), rows)])
    new = loaded + 1e-2 * torch.randn(2000, generator=g)
    drift.observe([("w", new, new.to(torch.bfloat16), rows)])
    got = reduce_drift([drift])
    assert drift.steps == 1 and got["lag_steps"] == 0
    assert got["changed_fraction"] == pytest.approx(
        changed_fraction(loaded.to(torch.bfloat16), new.to(torch.bfloat16)), rel=1e-6)
    assert int((drift.ring != 0).any(dim=1).sum()) == 1  # the old masters are gone from the history
