"""Drift telemetry: how far the served bf16 weights are from the fp32 master (DESIGN.md).

* ``changed_fraction[t]`` — fraction of served bf16 elements whose bits differ from step t-1.
* ``lag_steps[t]``       — argmin over k in [0, K] of ||served_t - master_{t-k}||^2 on a fixed
  random sample of elements: how old the served policy looks.
* ``gap_ulps[t]``        — mean |served - master| in units of the local bf16 spacing.
* :func:`logprob_gap`    — mean |log p_master - log p_served| per token and KL(master || served).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

_BINADE_TOP = 0x7F7E0000  # last bf16 pattern whose successor is finite (same binade as max)


def changed_fraction(previous: torch.Tensor, current: torch.Tensor) -> float:
    """Fraction (0..1) of elements whose bf16 bits differ.

    Args:
        previous, current: bfloat16 tensors of the same shape.

    Raises:
        ValueError: on different shapes; TypeError: if either is not bfloat16.
    """
    if previous.dtype != torch.bfloat16 or current.dtype != torch.bfloat16:
        raise TypeError(f"changed_fraction needs bfloat16 tensors, got {previous.dtype} and {current.dtype}")
    if previous.shape != current.shape:
        raise ValueError(f"shape mismatch: {tuple(previous.shape)} vs {tuple(current.shape)}")
    if previous.numel() == 0:
        return 0.0
    return (previous.view(torch.int16) != current.view(torch.int16)).float().mean().item()


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing (ulp) at each element of the float32 tensor ``x``, as float32.

    The spacing is that of the bf16 binade holding |x| (2**-133 for subnormals); for |x| at or
    above bf16 max it is the spacing of the top binade. NaN/Inf give NaN.
    """
    bits = x.float().abs().view(torch.int32) & 0x7FFF0000
    low = torch.clamp_max(bits, _BINADE_TOP)
    spacing = (low + 0x10000).view(torch.float32) - low.view(torch.float32)
    return torch.where(torch.isfinite(x), spacing, torch.nan)


def gap_ulps(served: torch.Tensor, master: torch.Tensor) -> float:
    """Mean |served - master| in bf16 ulps over the finite masters.

    Args:
        served: bfloat16 tensor; master: float32 tensor of the same shape.

    Returns:
        A float >= 0 (0.0 when there is no finite element). Round-to-nearest gives <= 0.5.
    """
    if served.shape != master.shape:
        raise ValueError(f"shape mismatch: {tuple(served.shape)} vs {tuple(master.shape)}")
    finite = torch.isfinite(master)
    if not bool(finite.any()):
        return 0.0
    gap = (served.float() - master).abs() / bf16_spacing(master)
    return gap[finite].mean().item()


class LagTracker:
    """``lag_steps``: which past master the served weights look like, on a fixed sample.

    Args:
        numel: number of elements in the flat parameter space being sampled.
        sample_size: how many elements to watch (fewer when ``numel`` is smaller).
        max_lag: K, the number of past master samples kept (ring buffer).
        seed: seeds the choice of the sample (a CPU ``torch.Generator``).

    ``self.index`` (int64 ``[sample_size]``, sorted) holds the sampled flat element indices,
    drawn uniformly with replacement (a repeat only weights an element twice; no O(numel) cost).
    Call :meth:`update` once per step with the master and served values at ``self.index``; it
    returns the lag in steps (int in [0, K]; capped by the number of steps seen so far).
    """

    def __init__(self, numel: int, sample_size: int = 65536, max_lag: int = 200, seed: int = 0):
        if numel <= 0 or sample_size <= 0 or max_lag < 0:
            raise ValueError(f"LagTracker needs numel > 0, sample_size > 0, max_lag >= 0; got "
                             f"{numel=}, {sample_size=}, {max_lag=}")
        g = torch.Generator().manual_seed(seed)
        self.index = torch.randint(numel, (sample_size,), generator=g).sort().values
        self.history: deque[torch.Tensor] = deque(maxlen=max_lag + 1)

    def update(self, master_sample: torch.Tensor, served_sample: torch.Tensor) -> int:
        """Record this step's master sample and return the lag of the served sample.

        Args:
            master_sample: float32 ``[sample_size]`` (the master at ``self.index``).
            served_sample: bfloat16 or float ``[sample_size]`` (the served weights there).
        """
        self.history.appendleft(master_sample.detach().float().clone())
        past = torch.stack(list(self.history))  # [k+1, S]: k = 0 is now
        dist = ((past - served_sample.float()) ** 2).sum(dim=1)
        return int(torch.argmin(dist))


def logprob_gap(master_logits: torch.Tensor, served_logits: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[float, float]:
    """Per-token log-probability gap between the master and the served model.

    Args:
        master_logits, served_logits: ``[B, T, V]`` logits predicting ``targets``.
        targets: ``[B, T]`` int64 next-token ids.
        mask: optional ``[B, T]`` bool, the tokens that count (default all).

    Returns:
        ``(mean |log p_master(y) - log p_served(y)|, mean KL(p_master || p_served))`` per counted
        token, in nats.
    """
    lp_m = F.log_softmax(master_logits.float(), dim=-1)
    lp_s = F.log_softmax(served_logits.float(), dim=-1)
    tok_m = lp_m.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    tok_s = lp_s.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kl = (lp_m.exp() * (lp_m - lp_s)).sum(-1)
    if mask is None:
        mask = torch.ones_like(targets, dtype=torch.bool)
    return (tok_m - tok_s).abs()[mask].mean().item(), kl[mask].mean().item()
