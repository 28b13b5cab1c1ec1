"""Drift telemetry through DeepSpeed's monitor (TensorBoard / CSV / W&B / Comet), when configured.

After each export, every rank measures its own shard and the sums are all-reduced (a few
scalars and a ``K+1`` vector), so the numbers describe the whole model:

* ``Train/Samples/export_cast/changed_fraction`` — served bf16 elements whose bits changed.
* ``Train/Samples/export_cast/lag_steps`` — argmin over k of ||served_t - master_{t-k}||^2.
* ``Train/Samples/export_cast/gap_ulps`` — mean |served - master| in bf16 ulps.
* ``Train/Samples/export_cast/export_ms`` — wall time of the export on the slowest rank.

``lag_steps`` and ``gap_ulps`` use a fixed random sample of each rank's elements (``sample``
per rank); ``changed_fraction`` counts every element, which keeps a bf16 copy of the rank's
served shard (2 bytes per element) — the memory this costs only when a monitor is enabled.
"""
from __future__ import annotations

from collections import deque

import torch
from deepspeed import comm as dist

from faircast_dist.telemetry import bf16_spacing

PREFIX = "Train/Samples/export_cast/"


class DriftMonitor:
    """Per-step drift of one :class:`~deepspeed_hooks.export.OptimizerExport` (see module doc).

    Args:
        sample: elements sampled per rank for lag and gap.
        max_lag: K, past master samples kept.
    """

    def __init__(self, sample: int = 4096, max_lag: int = 100):
        self.sample, self.history = sample, deque(maxlen=max_lag + 1)
        self.previous: list[torch.Tensor] | None = None
        self.where = None  # (group index, position) of each sampled element
        self.events: dict[str, float] = {}

    @torch.no_grad()
    def update(self, export, export_ms: float) -> None:
        groups = export.groups()
        served = [self._served(fragments, hp) for hp, fragments in groups]
        changed = torch.zeros(2, dtype=torch.float64)  # [changed elements, elements]
        for i, now in enumerate(served):
            if self.previous is not None:
                changed[0] += int((self.previous[i].view(torch.int16) != now.view(torch.int16)).sum())
            changed[1] += sum(f.numel for f in groups[i][1])
        self.previous = served
        if self.where is None:
            self.where = self._choose(groups, dist.get_rank())
        master = torch.cat([groups[g][0].view(-1)[pos] for g, pos in self.where]) if self.where else torch.zeros(0)
        out = torch.cat([served[g][pos] for g, pos in self.where]).float() if self.where else torch.zeros(0)
        self.history.appendleft(master.clone())
        dists = torch.stack([((m - out) ** 2).sum().double() for m in self.history])
        finite = torch.isfinite(master)
        gap = torch.tensor([((out - master).abs() / bf16_spacing(master))[finite].sum().item(), finite.sum().item()],
                           dtype=torch.float64)
        ms = torch.tensor([export_ms], dtype=torch.float64)
        for t in (changed, dists, gap):
            dist.all_reduce(t)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        self.events = {"changed_fraction": (changed[0] / changed[1]).item() if self.previous is not None else 0.0,
                       "lag_steps": int(torch.argmin(dists)), "gap_ulps": (gap[0] / gap[1].clamp_min(1)).item(),
                       "export_ms": ms.item()}

    @staticmethod
    def _served(fragments, hp) -> torch.Tensor:
        out = torch.zeros(hp.numel(), dtype=torch.bfloat16)
        for f in fragments:
            out.narrow(0, f.start, f.numel).copy_(f.out)
        return out

    def _choose(self, groups, rank):
        starts = [(g, f.start, f.numel) for g, (_, frags) in enumerate(groups) for f in frags]
        total = sum(n for _, _, n in starts)
        if not total:
            return []
        if total <= self.sample:  # small shard: watch every element
            picks = torch.arange(total)
        else:  # uniform with replacement: no O(total) permutation
            gen = torch.Generator().manual_seed(rank)
            picks = torch.randint(total, (self.sample,), generator=gen).sort().values
        edges = torch.tensor([0] + [n for _, _, n in starts]).cumsum(0)
        which = torch.searchsorted(edges, picks, right=True) - 1
        where = {}
        for k, (g, start, _) in enumerate(starts):
            sel = picks[which == k] - edges[k] + start
            if sel.numel():
                where.setdefault(g, []).append(sel)
        return [(g, torch.cat(v)) for g, v in sorted(where.items())]

    def write(self, monitor, samples: int) -> None:
        """Send the values of an export not yet reported to DeepSpeed's ``MonitorMaster``."""
        if self.events:
            monitor.write_events([(PREFIX + k, v, samples) for k, v in self.events.items()])
            self.events = {}
