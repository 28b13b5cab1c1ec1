"""The declared statistics of the RL comparison (``scripts/rl_grpo.py``), over rows of ``steps.csv``:
per-pair scores, wins / ties / losses against round-to-nearest with a tie band, the paired bootstrap
interval of the mean gain, the recovery of the fp32 oracle's gain, mean curves, the lag peak and the
reward's rise. Pure functions of the rows (torch only): the tests import this module, not the script.
"""
from __future__ import annotations

import math

import torch

BASELINE = "nearest"  # what the bf16 arms (and the oracle) are compared with
FP8_BASELINE = "fp8_nearest"  # what the FP8 arms (fp8_*) are compared with: round-to-nearest into FP8


def baseline_of(arm: str) -> str:
    """The arm ``arm`` is compared with: round-to-nearest into the format it serves (:data:`FP8_BASELINE` for an
    ``fp8_*`` arm, else :data:`BASELINE`)."""
    return FP8_BASELINE if arm.startswith("fp8_") else BASELINE


def compare_formats(scores: dict[int, dict[str, float]], tie_band: float,
                    oracle: str | None = None) -> tuple[dict[str, dict], dict[str, float]]:
    """:func:`compare_arms` of every arm against its own baseline (:func:`baseline_of`), over the pairs that ran it
    (launches merged with other ``--arms`` leave an arm on some pairs only), with its :func:`recovery` of the
    ``oracle``'s gain over that baseline.

    Returns:
        ``(table, oracle_gains)``. ``table``: ``{arm: compare_arms' row + "recovery" (float or None, see
        :func:`recovery`) + "oracle_gain" (points)}``, both gains (the arm's and the oracle's over the arm's
        baseline) averaged over the same pairs, those that ran the arm, its baseline and the oracle;
        ``"oracle_gain"`` is None for a baseline, the oracle, or an arm no such pair ran. The oracle's own row
        is against :data:`BASELINE`. ``oracle_gains``: ``{baseline: the oracle's mean gain over it}``, over the
        pairs that ran both.

    Raises:
        ValueError: a pair that ran an arm but not its baseline (named), a negative ``tie_band``.
    """
    table, oracle_gains = {}, {}
    for base in sorted({baseline_of(a) for arms in scores.values() for a in arms}):
        sub = {p: {a: v for a, v in arms.items() if baseline_of(a) == base or a == oracle}
               for p, arms in scores.items() if base == BASELINE or any(baseline_of(a) == base for a in arms)}
        rows = compare_arms(sub, tie_band, base)  # raises for a pair without base
        both = [p for p, arms in sub.items() if oracle in arms]
        if both:
            oracle_gains[base] = sum(sub[p][oracle] - sub[p][base] for p in both) / len(both)
        for arm, row in rows.items():
            if arm == oracle and base != BASELINE:
                continue
            common = [p for p, arms in sub.items() if arm in arms and oracle in arms]
            row.update(recovery=None, oracle_gain=None)
            if arm not in (base, oracle) and common:
                gain = sum(sub[p][arm] - sub[p][base] for p in common) / len(common)
                row["oracle_gain"] = sum(sub[p][oracle] - sub[p][base] for p in common) / len(common)
                row["recovery"] = recovery(gain, row["oracle_gain"], tie_band)
            table[arm] = row
    return table, oracle_gains


def arm_scores(records: list[dict], last: int | None = None, key: str = "eval_acc") -> dict[int, dict[str, float]]:
    """``{pair_seed: {arm: mean held-out accuracy (points)}}`` over all of the arm's evals in step order (the
    primary score: the area under its learning curve), or over its last ``last`` evals (the secondary one);
    ``key``: ``eval_acc`` (the served policy) or ``master_acc`` (the fp32 masters)."""
    evals: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for r in records:
        if r.get(key) is not None:
            evals.setdefault(r["pair_seed"], {}).setdefault(r["arm"], []).append((r["step"], r[key]))
    out = {}
    for s, arms in evals.items():
        out[s] = {}
        for a, v in arms.items():
            accs = [acc for _, acc in sorted(v)][-last if last else None:]
            out[s][a] = sum(accs) / len(accs)
    return out


def paired_bootstrap_ci(gains: list[float], level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-pair gains (Efron & Tibshirani, "An Introduction to the
    Bootstrap", 1993, ch. 13): the pairs are resampled with replacement ``resamples`` times (torch generator
    ``seed``: the same interval every run), and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    the resampled means are returned (points).

    Raises:
        ValueError: no gains, ``level`` outside (0, 1) or ``resamples`` < 1.
    """
    if not gains:
        raise ValueError("paired_bootstrap_ci needs at least one pair's gain")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"level must be in (0, 1) and resamples >= 1, got {level}, {resamples}")
    g = torch.tensor(gains, dtype=torch.float64)
    pick = torch.randint(len(gains), (resamples, len(gains)), generator=torch.Generator().manual_seed(seed))
    means = g[pick].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def compare_arms(scores: dict[int, dict[str, float]], tie_band: float, baseline: str = BASELINE) -> dict[str, dict]:
    """Wins / ties / losses of every arm against ``baseline``, pair by pair.

    Args:
        scores: ``{pair: {arm: score in points}}`` (:func:`arm_scores`); every pair must score the baseline.
        tie_band: an arm wins a pair when ``score - baseline >= tie_band``, loses when
            ``<= -tie_band``, else ties (points; declared before running); an equal score always ties
            (with ``tie_band`` 0 too).

    Returns:
        ``{arm: {"wins", "ties", "losses": int, "mean_gain": mean of score - baseline (points),
        "gain_ci": its 95% paired bootstrap interval (:func:`paired_bootstrap_ci`), "mean_score": float,
        "pairs": int}}``, the baseline included (all ties, gain 0).

    Raises:
        ValueError: a pair without a baseline score, or a negative ``tie_band``.
    """
    if tie_band < 0:
        raise ValueError(f"tie_band must be >= 0, got {tie_band}")
    out: dict[str, dict] = {}
    for pair, arms in scores.items():
        if baseline not in arms:
            raise ValueError(f"pair {pair} has no {baseline!r} score: {sorted(arms)}")
        for arm, score in arms.items():
            d = out.setdefault(arm, dict(wins=0, ties=0, losses=0, gains=[], scores=[]))
            gain = score - arms[baseline]
            d["wins" if gain >= tie_band and gain > 0 else "losses" if gain <= -tie_band and gain < 0 else "ties"] += 1
            d["gains"].append(gain)
            d["scores"].append(score)
    return {arm: dict(wins=d["wins"], ties=d["ties"], losses=d["losses"], pairs=len(d["gains"]),
                      mean_gain=sum(d["gains"]) / len(d["gains"]), mean_score=sum(d["scores"]) / len(d["scores"]),
                      gain_ci=paired_bootstrap_ci(d["gains"]))
            for arm, d in out.items()}


def recovery(gain: float, oracle_gain: float, tie_band: float) -> float | None:
    """The share of the oracle's gain over ``nearest`` that an arm recovers: ``gain / oracle_gain`` =
    (arm - nearest) / (fp32 - nearest), on mean primary scores (points). 1: the arm learns as fast as the
    unrounded policy; 0: no faster than round-to-nearest; < 0: slower.

    Declared before running: None (not reported) when the oracle's mean gain is below ``tie_band`` (or
    negative), since there is then no gain of the oracle's to recover.
    """
    return gain / oracle_gain if oracle_gain >= tie_band and oracle_gain > 0 else None


def mean_curves(records: list[dict], arm: str, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(steps, mean, 25th, 75th percentile)`` over pairs of ``key`` per step, for one arm (the
    steps where the arm's rows have ``key``)."""
    by_step: dict[int, list[float]] = {}
    for r in records:
        if r["arm"] == arm and r.get(key) is not None:
            by_step.setdefault(r["step"], []).append(float(r[key]))
    xs = sorted(by_step)
    vals = [torch.tensor(by_step[x], dtype=torch.float64) for x in xs]
    return (xs, [v.mean().item() for v in vals], [torch.quantile(v, 0.25).item() for v in vals],
            [torch.quantile(v, 0.75).item() for v in vals])


def arm_mean(records: list[dict], arm: str, key: str) -> float:
    """The mean of ``key`` over the arm's rows that have it (all pairs and steps); NaN when none has it."""
    vals = [r[key] for r in records if r["arm"] == arm and r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def lag_peak(records: list[dict], arm: str) -> float:
    """The peak over steps of the arm's lag (steps), averaged over pairs (the step-0 row has no lag)."""
    return max(mean_curves(records, arm, "lag_steps")[1], default=float("nan"))


def reward_rise(records: list[dict], arm: str, window: int = 30) -> tuple[float, float, float]:
    """How far the arm's rollout reward (mean per step, over pairs) rose: ``(first, last, share)`` with first
    and last the means over its first and last ``window`` steps (at most half the run each) and share =
    (last - first) / (1 - first), the part of its room (reward 1 = every completion right) it climbed.
    NaNs when the arm has no rewarded steps."""
    steps, curve, _, _ = mean_curves(records, arm, "reward")
    if not steps:
        return (float("nan"),) * 3
    k = max(1, min(window, len(steps) // 2))
    first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
    return first, last, (last - first) / (1 - first) if first < 1 else float("nan")


def fitted_delay(records: list[dict], arm: str, key: str, reference: str) -> float:
    """How many steps the arm's held-out curve trails ``reference``'s: the shift d (whole steps, 0 to the last
    eval step) that minimises the mean over the arm's eval steps t of (arm(t) - ref(t - d))**2, on the mean
    curves over pairs of ``key`` (``eval_acc``: the served policy; ``master_acc``: the masters), ref linearly
    interpolated between its evals and held at its step-0 value before step 0. The smallest such d on ties;
    NaN when either arm has no evals or a NaN score. A curve that never rises fits every d alike (then 0): read it beside the
    curves.
    """
    xs, ys, _, _ = mean_curves(records, arm, key)
    rx, ry, _, _ = mean_curves(records, reference, key)
    if not xs or not rx or any(math.isnan(v) for v in ys + ry):
        return float("nan")

    def ref(t: float) -> float:
        if t <= rx[0]:
            return ry[0]
        for (x0, y0), (x1, y1) in zip(zip(rx, ry), zip(rx[1:], ry[1:])):
            if t <= x1:
                return y0 + (y1 - y0) * (t - x0) / (x1 - x0)
        return ry[-1]

    errors = [sum((y - ref(x - d)) ** 2 for x, y in zip(xs, ys)) / len(xs) for d in range(int(xs[-1]) + 1)]
    return float(errors.index(min(errors)))
