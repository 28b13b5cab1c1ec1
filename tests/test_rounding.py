"""The casts: exactness of nearest, the statistics that define stochastic / dithered rounding and
error feedback, shard invariance and IEEE edge cases (docs/design.md invariants 1 and 5).

Stochastic and dithered rounding are the same cast with different Philox keys; the tests that
take ``method`` run both through :class:`FairCaster` (its key choice included)."""
import math

import pytest
import torch

from faircast_dist import FairCaster, block_index, cast_error_feedback, cast_nearest, cast_stochastic, derive_key
from faircast_dist.rounding import BF16_MAX, stochastic_round
from faircast_dist.telemetry import bf16_spacing

KEY = derive_key(1234, 0, "w")
RANDOM_METHODS = ("stochastic", "dithered")


def caster(method, seed=1234):
    return FairCaster({"mode": "fair", "method": method, "seed": seed})
TINY_SUB = 2.0**-133  # smallest bf16 subnormal (an fp32 subnormal)


def random_fp32_patterns(n, seed=0):
    """Every kind of fp32: random bit patterns (normals, subnormals, NaNs, Infs, zeros)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 3.4e38, -3.4e38,
                             float(BF16_MAX), 1.0, -1.0], dtype=torch.float32)
    return torch.cat([bits.view(torch.float32), specials])


def test_nearest_is_to_bfloat16_bit_for_bit():
    x = random_fp32_patterns(1 << 16)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    cast_nearest(x, out)
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def draws(x, n, method="stochastic"):
    """n stochastic / dithered roundings of the value x (n elements with different counters)."""
    return caster(method).cast("w", torch.full((n,), x, dtype=torch.float32))


@pytest.mark.parametrize("method", RANDOM_METHODS)
@pytest.mark.parametrize("x", [0.3, -0.3, 1.0 - 2**-20, -(2.0 - 2**-17), 1e-3, 1.5 * TINY_SUB,
                               -7.25 * TINY_SUB, 1e-39, 12345.678])
def test_stochastic_is_unbiased(x, method):
    n = 200_000
    xf = torch.tensor(x, dtype=torch.float32)
    q = draws(x, n, method).float()
    lo, hi = q.min().item(), q.max().item()
    assert hi - lo <= bf16_spacing(xf).item() * 1.0001  # only the two neighbours occur
    p = (xf.item() - lo) / (hi - lo) if hi > lo else 0.0
    sd = (hi - lo) * math.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(q.double().mean().item() - xf.item()) <= 5 * sd + 1e-45  # 5 sigma


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_round_up_frequency_matches_fractional_position(method):
    n = 100_000
    for frac in [1 / 64, 0.25, 0.5, 0.75, 63 / 64]:
        x = 1.0 + frac * 2**-7  # between 1 and the next bf16 value 1 + 2**-7
        up = (draws(x, n, method).float() > 1.0).double().mean().item()
        assert abs(up - frac) <= 5 * math.sqrt(frac * (1 - frac) / n)


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_exact_bf16_values_never_move(method):
    x = torch.randn(10_000).to(torch.bfloat16).float()
    assert torch.equal(caster(method).cast("w", x), x.to(torch.bfloat16))


@pytest.mark.parametrize("x", [0.3, -0.3, 1.0 + 2**-8, 1.0 - 2**-20, -(2.0 - 2**-17), 1e-3, 1.5 * TINY_SUB,
                               -7.25 * TINY_SUB, 1e-39, 12345.678, 3.3e38])
def test_exactly_unbiased_over_all_2_16_dithers(x):
    """E[q] = x exactly when the 16 random bits take each of their 2**16 values once: both
    stochastic rounding (bits redrawn per export) and dithered rounding (bits fixed per element)
    are unbiased over the random bits, not just in the large-sample limit."""
    xf = torch.tensor(x, dtype=torch.float32)
    q = stochastic_round(xf.expand(2**16), torch.arange(2**16, dtype=torch.int32))
    assert q.double().sum().item() == xf.double().item() * 2**16  # exact in float64


def test_dithered_serves_identical_bits_for_an_unchanged_master():
    """No flip-flop: the dither is fixed, so an unchanged master is served the same bits at every
    export (stochastic rounding redraws and changes about 2p(1-p) of them each time)."""
    x = torch.randn(50_000)
    dithered, sr = caster("dithered"), caster("stochastic")
    first_d, first_sr = dithered.cast("w", x), sr.cast("w", x)
    for _ in range(5):
        dithered.advance(), sr.advance()
        assert torch.equal(dithered.cast("w", x).view(torch.int16), first_d.view(torch.int16))
        assert (sr.cast("w", x).view(torch.int16) != first_sr.view(torch.int16)).float().mean() > 0.2
    # the seed and the name key the dither; it is never stochastic rounding's bits of a step
    assert not torch.equal(caster("dithered", seed=1235).cast("w", x), first_d)
    assert not torch.equal(dithered.cast("v", x), first_d)
    for step in range(20):
        assert not torch.equal(cast_stochastic(x, derive_key(1234, step, "w"), 0), first_d)


@pytest.mark.parametrize("method", ("nearest", "dithered", "stochastic"))
def test_churn_on_a_synthetic_drift(method):
    """Share of served elements that change per export under a random-walk drift of the master.

    Dithered rounding: each element has one fixed threshold, uniform over its bf16 interval, so
    it changes exactly when the master crosses it: P(change) = |update| / spacing (for |update|
    below one spacing). Round-to-nearest has the same churn on masters spread uniformly over
    the interval (its threshold is the midpoint). Stochastic rounding redraws: an element at
    fractional positions p then p' (same neighbours) changes with probability p(1-p') + p'(1-p),
    about 1/3 for uniform p, whatever the update. Tolerance: 5 binomial sigma of the per-step share.
    """
    n, g = 200_000, torch.Generator().manual_seed(5)
    x = 1.01 + 0.97 * torch.rand(n, generator=g)  # stays in [1, 2) over 4 steps: spacing 2**-7
    spacing = 2.0**-7
    size = 0.2 * spacing * torch.rand(n, generator=g)  # |update| per element, up to 0.2 ulp
    c = caster(method) if method != "nearest" else FairCaster(None)
    prev = c.cast("w", x)
    for _ in range(4):
        c.advance()
        old, x = x, x + size * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        q = c.cast("w", x)
        churn = (q.view(torch.int16) != prev.view(torch.int16)).double().mean().item()
        prev = q
        if method == "stochastic":  # P(two independent draws at old, x agree), neighbours compared
            lo0, lo1 = [(t.view(torch.int32) & -65536).view(torch.float32) for t in (old, x)]
            p0, p1 = (old - lo0).double() / spacing, (x - lo1).double() / spacing
            same = torch.where(lo0 == lo1, (1 - p0) * (1 - p1) + p0 * p1,
                               torch.where(lo1 > lo0, p0 * (1 - p1), (1 - p0) * p1))
            expected = 1 - same.mean().item()
            assert 0.3 < expected < 0.37  # about 1/3
        else:
            expected = (size / spacing).double().mean().item()  # 0.1
        assert abs(churn - expected) <= 5 * (0.25 / n) ** 0.5, (method, churn, expected)


def test_stochastic_deterministic_and_keyed():
    x = torch.randn(4096)
    a, b = cast_stochastic(x, KEY, 0), cast_stochastic(x, KEY, 0)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    c = cast_stochastic(x, derive_key(1234, 1, "w"), 0)  # next step: other draws
    assert (a.view(torch.int16) != c.view(torch.int16)).any()


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_shard_invariance_contiguous_and_strided(method):
    x = torch.randn(48, 40)
    c = caster(method)
    full_idx = block_index((48, 40), (0, 0), (48, 40))
    whole = c.cast("w", x, full_idx)
    assert torch.equal(whole.view(torch.int16), c.cast("w", x, 0).view(torch.int16))
    # column-parallel (rows) and row-parallel (columns) TP=4 shards, given their global offsets
    for dim in (0, 1):
        parts = []
        for r, xs in enumerate(x.chunk(4, dim=dim)):
            off = (r * xs.shape[0], 0) if dim == 0 else (0, r * xs.shape[1])
            parts.append(c.cast("w", xs.contiguous(), block_index(x.shape, off, xs.shape)))
        assert torch.equal(torch.cat(parts, dim=dim).view(torch.int16), whole.view(torch.int16))
    # ZeRO-style uneven contiguous partitions of the flattened param, given their start offsets
    flat, cuts = x.reshape(-1), [0, 7, 500, 1201, 1920]
    parts = [c.cast("w", flat[a:b], a) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts).view(torch.int16), whole.reshape(-1).view(torch.int16))


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_stochastic_ieee_edge_cases(method):
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 3.4e38, -3.4e38,
                      float(BF16_MAX), TINY_SUB * 0.5, -TINY_SUB * 0.25])
    for seed in range(50):  # other seeds: other random bits for either method
        q = caster(method, seed).cast("edge", x)
        assert math.isnan(q[0]) and q[1] == math.inf and q[2] == -math.inf
        assert q[3].view(torch.int16) == 0 and q[4].view(torch.int16) == torch.tensor(-0.0).to(torch.bfloat16).view(torch.int16)
        assert q[5] == BF16_MAX and q[6] == -BF16_MAX and q[7] == BF16_MAX  # saturate, never Inf
        assert q[8].item() in (0.0, TINY_SUB) and q[9].item() in (0.0, -TINY_SUB)
        assert torch.isfinite(q[3:]).all()


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_random_patterns_stay_in_class_and_between_neighbours(method):
    x = random_fp32_patterns(1 << 16, seed=3)
    q = caster(method).cast("w", x)
    fin = torch.isfinite(x)
    assert torch.equal(torch.isnan(q), torch.isnan(x))
    assert torch.equal(q[~fin & ~torch.isnan(x)], x[~fin & ~torch.isnan(x)].to(torch.bfloat16))
    assert torch.isfinite(q[fin]).all()
    # q is one of the two bf16 neighbours (toward zero, or one ulp away), same sign bit
    t = (x.view(torch.int32) & -65536).view(torch.float32)  # truncation toward zero
    qf = q.float()
    away = t + torch.sign(x) * bf16_spacing(x)
    ok = (qf == t) | (qf == away) | (qf.abs() == BF16_MAX)
    assert ok[fin].all()
    assert torch.equal(torch.signbit(q[fin]), torch.signbit(x[fin]))


def test_stochastic_round_rejects_nothing_of_its_range():
    x = torch.tensor([1.0 + 2**-8])  # exactly half way: rounds up for bits >= 2**15
    lo = stochastic_round(x, torch.tensor([2**15 - 1], dtype=torch.int32))
    hi = stochastic_round(x, torch.tensor([2**15], dtype=torch.int32))
    assert lo.item() == 1.0 and hi.item() == 1.0 + 2**-7


def test_error_feedback_tracks_master_within_one_ulp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g)
    e = torch.zeros_like(x)
    total_gap = torch.zeros_like(x, dtype=torch.float64)
    s = bf16_spacing(x)
    for t in range(300):
        x = x + 1e-5 * torch.randn(x.shape, generator=g)  # small AdamW-like updates
        e_prev = e.clone()
        q = cast_error_feedback(x, e)
        # |e| <= half a spacing, so |q - x| = |e_prev - e| stays within one bf16 spacing (that of
        # the larger binade when x moved across a power of two between steps)
        assert (e.abs() <= 0.5 * torch.maximum(bf16_spacing(x + e_prev), bf16_spacing(q.float()))).all()
        big = torch.maximum(bf16_spacing(x), bf16_spacing(q.float()))
        fp32_slack = big * 2**-15  # y = x + e_prev is itself rounded to fp32
        assert ((q.float() - x).abs() <= e_prev.abs() + e.abs() + fp32_slack).all()
        assert ((q.float() - x).abs() <= big).float().mean() > 0.999
        total_gap += q.double() - x.double()
    # sum_t (q_t - x_t) = -e_T (telescoping): the time-average of served tracks the master
    assert ((total_gap + e.double()).abs() <= 1e-3 * s).all()
    assert ((total_gap / 300).abs() <= s / 300 * 1.01).all()


def test_error_feedback_moves_with_small_updates_where_nearest_does_not():
    x = torch.full((1000,), 1.0)
    e = torch.zeros_like(x)
    upd = 2**-7 / 10  # a tenth of a bf16 ulp per step
    changed_rtn, changed_ef = 0, 0
    q_prev_rtn = q_prev_ef = x.to(torch.bfloat16)
    for _ in range(20):
        x = x + upd
        q_rtn, q_ef = cast_nearest(x), cast_error_feedback(x, e)
        changed_rtn += int((q_rtn != q_prev_rtn).sum())
        changed_ef += int((q_ef != q_prev_ef).sum())
        q_prev_rtn, q_prev_ef = q_rtn, q_ef
    assert changed_ef >= 1000  # every element moved at least once over 2 ulps of drift


def test_error_feedback_non_finite_master_never_poisons_residual():
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0, 3.4e38])
    e = torch.tensor([1e-4, -1e-4, 2e-4, 1e-3, 0.0])
    q = cast_error_feedback(x, e)
    assert math.isnan(q[0]) and q[1] == math.inf and q[2] == -math.inf
    assert torch.equal(e[:3], torch.tensor([1e-4, -1e-4, 2e-4]))  # kept, not reset or NaN
    assert torch.isfinite(e).all() and q[4] == BF16_MAX  # saturated, residual finite
    assert q[3].item() == 1.0 and e[3].item() == pytest.approx(1e-3, rel=1e-4)


def test_error_feedback_bf16_residual_and_zeros():
    x = torch.tensor([0.0, -0.0, 1.0 + 2**-10])
    e = torch.zeros(3, dtype=torch.bfloat16)
    q = cast_error_feedback(x, e)
    assert torch.equal(q.view(torch.int16)[:2], x[:2].to(torch.bfloat16).view(torch.int16))
    assert e[2].item() == 2**-10


@pytest.mark.parametrize("bad,match", [
    (dict(master=torch.zeros(3, dtype=torch.float64)), "master shard must be float32"),
    (dict(out=torch.zeros(3)), "output shard must be bfloat16"),
    (dict(out=torch.zeros(4, dtype=torch.bfloat16)), "shape"),
])
def test_bad_input(bad, match):
    args = dict(master=torch.zeros(3), out=None) | bad
    with pytest.raises((TypeError, ValueError), match=match):
        cast_stochastic(args["master"], KEY, 0, args["out"])
    with pytest.raises((TypeError, ValueError), match="index shape"):
        cast_stochastic(torch.zeros(3), KEY, torch.arange(4))
    with pytest.raises(ValueError, match="residual shape"):
        cast_error_feedback(torch.zeros(3), torch.zeros(4))


def test_non_contiguous_masters_and_bad_arguments():
    m = torch.randn(6, 5)
    for master in (m.t(), m[:, ::2]):  # transposed (dense) and strided views cast like their copies
        assert torch.equal(cast_stochastic(master, KEY, 0), cast_stochastic(master.contiguous(), KEY, 0))
        e1, e2 = torch.full(master.shape, 1e-3), torch.full(master.shape, 1e-3)
        assert torch.equal(cast_error_feedback(master, e1), cast_error_feedback(master.contiguous(), e2))
        assert torch.equal(e1, e2)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        cast_error_feedback(m, torch.zeros(5, 6).t())
    with pytest.raises(TypeError, match="index must be an integer tensor"):
        cast_stochastic(m, KEY, torch.zeros(6, 5))
    with pytest.raises(ValueError, match="index must be an int start offset"):
        cast_stochastic(m, KEY, 2**63 - 10)
