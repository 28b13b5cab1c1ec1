"""Does round-to-nearest lag only where the masters start on the served grid? A simulation, no training.

    python scripts/fp8_start_lag.py     # ~1 minute on one core

64 x 1024 masters drawn N(0, 0.03) and rounded to bf16 (as an RL run from a bf16 checkpoint starts), or then
rounded onto the E4M3 grid of their UE8M0 channel scales (as a run from an FP8 checkpoint starts: exactly bf16
too), take 300 steps of 3e-6 * clamp(mu + N(0, 1), -3, 3), mu ~ N(0, 0.3) per element (a drift under
Adam-sized noise). Each step every cast serves the masters, the FP8 ones with the start's sticky scales (no
rescale). Printed per cast: the least-squares lag (:class:`faircast_dist.telemetry.LagTracker`, 100 steps at
most) and the share of the masters' move since the start that the served copy carries,
``<served_t - served_0, m_t - m_0> / |m_t - m_0|^2`` (1: it follows the master; 0: it stays put), and the
mean |served - master| / mean |master| at the end. Results: docs/rl-results.md ("FP8 from masters on the E4M3
grid").
"""
import torch

from faircast_dist.fp8 import ScaleRule
from faircast_dist.rounding import cast_fp8_nearest, cast_fp8_stochastic, cast_stochastic
from faircast_dist.telemetry import LagTracker

N, K, STEPS, LR = 64, 1024, 300, 3e-6
CASTS = ("bf16_nearest", "bf16_dithered", "fp8_nearest", "fp8_dithered", "fp8_stochastic")
LAYOUT = ScaleRule("channel", ue8m0=True)
INDEX = torch.arange(N * K).view(N, K)


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    return LAYOUT.scales(w.abs().amax(1, keepdim=True)).expand(N, K).contiguous()


def serve(cast: str, w: torch.Tensor, s: torch.Tensor, step: int) -> torch.Tensor:
    """The served values (fp32) of masters ``w`` at ``step``; FP8: ``q * s``. Dithered: a key without the step."""
    if cast == "bf16_nearest":
        return w.bfloat16().float()
    if cast == "bf16_dithered":
        return cast_stochastic(w, (7, 0), INDEX).float()
    if cast == "fp8_nearest":
        return cast_fp8_nearest(w, s).float() * s
    return cast_fp8_stochastic(w, s, (7, 0 if cast == "fp8_dithered" else step + 1), INDEX).float() * s


def main() -> None:
    torch.manual_seed(0)
    bf16_start = (torch.randn(N, K) * 0.03).bfloat16().float()
    mu = torch.randn(N, K) * 0.3
    s0 = channel_scales(bf16_start)
    grid_start = cast_fp8_nearest(bf16_start, s0).float() * s0
    assert torch.equal(grid_start, grid_start.bfloat16().float())  # on both grids
    for label, start in (("bf16 masters (off the E4M3 grid)", bf16_start), ("masters on the E4M3 grid", grid_start)):
        print(f"== {label}")
        for cast in CASTS:
            g = torch.Generator().manual_seed(1)  # the same master trajectory for every cast
            w, s = start.clone(), channel_scales(start)
            served0 = serve(cast, w, s, 0)
            tracker = LagTracker(N * K, 65536, 100, seed=0)
            tracker.update(w.view(-1)[tracker.index], served0.view(-1)[tracker.index])
            lags, carried = [], []
            for step in range(STEPS):
                w = w + LR * torch.clamp(mu + torch.randn(N, K, generator=g), -3, 3)
                served = serve(cast, w, s, step)
                lags.append(tracker.update(w.view(-1)[tracker.index], served.view(-1)[tracker.index]))
                move = (w - start).view(-1)
                carried.append(float((served - served0).view(-1) @ move / (move @ move)))
            err = float((served - w).abs().mean() / w.abs().mean())
            print(f"{cast:15s} lag at step 50/100/200/300: {lags[49]:3d} {lags[99]:3d} {lags[199]:3d} {lags[-1]:3d}"
                  f"   share carried at 50/100/300: {carried[49]:.2f} {carried[99]:.2f} {carried[-1]:.2f}"
                  f"   mean |err| / mean |w|: {err:.4f}")


if __name__ == "__main__":
    main()
