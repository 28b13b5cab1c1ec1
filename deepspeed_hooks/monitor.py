"""Drift telemetry through DeepSpeed's monitor (TensorBoard / CSV / W&B / Comet), when configured.

After each export every rank measures the elements it casts on their device
(:class:`faircast_dist.telemetry.DriftSample`: a fixed sample of about ``sample`` elements of the
whole model, chosen by global element index, the same in every layout), and one small all-reduce
per optimizer step gives the numbers for the whole model:

* ``Train/Samples/export_cast/changed_fraction`` — sampled served bf16 elements whose bits changed.
* ``Train/Samples/export_cast/lag_steps`` — argmin over k of ||served_t - master_{t-k}||^2.
* ``Train/Samples/export_cast/gap_ulps`` — mean |served - master| in bf16 ulps.
* ``Train/Samples/export_cast/export_ms`` — wall time of the export on the slowest rank.

Per step this costs two index-selects of the sample on the device and a ``K + 5`` float64
all-reduce; the only host transfer is those few numbers. Device memory: ``(K + 1)`` float32
master samples (``4 * (K + 1) * sample / world`` bytes per rank). Stage 0 (every rank casts the
whole model) is counted on rank 0 only.
"""
from __future__ import annotations

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from faircast_dist.telemetry import DriftSample, ExportTimer, reduce_drift, sample_stride

PREFIX = "Train/Samples/export_cast/"


class DriftMonitor:
    """Per-step drift of one :class:`~deepspeed_hooks.export.OptimizerExport` (see module doc).

    Args:
        total: elements in the whole model (the same on every rank).
        sample: about how many of them to watch.
        max_lag: K, past master samples kept.

    Attributes:
        timer: the :class:`~faircast_dist.telemetry.ExportTimer` the export starts and stops
            (one span per group cast).
        events: the values of the last export not yet written (``{name: float}``).
    """

    def __init__(self, total: int, sample: int = 65536, max_lag: int = 100):
        self.drift = DriftSample(sample_stride(total, sample), max_lag)
        self.timer = ExportTimer()
        self.events: dict[str, float] = {}

    def prime(self, export) -> None:
        """Before the first export's cast: record the served model it replaces (as initialised or
        loaded), so that the first ``changed_fraction`` is the change from it."""
        self.drift.prime(self._pieces(export), device=get_accelerator().current_device_name())

    def update(self, export) -> None:
        """Measure the export just finished (collective: every rank calls it)."""
        self.drift.observe(self._pieces(export), device=get_accelerator().current_device_name())
        self.events = reduce_drift([self.drift], self.timer.ms())

    def _pieces(self, export) -> list:
        """:meth:`DriftSample.observe`'s pieces: the groups this rank counts, with their served bf16."""
        from deepspeed_hooks.export import _flat_out
        pieces = []
        if not export.replicated or dist.get_rank() == 0:
            for i, (hp, fragments) in enumerate(export.groups()):
                flat, out = hp.view(-1), _flat_out(fragments)
                if out is not None:
                    pieces.append((i, flat, out, [(f.name, f.start, f.numel, f.index) for f in fragments]))
                else:
                    pieces += [((i, j), flat.narrow(0, f.start, f.numel), f.out.view(-1), [(f.name, 0, f.numel, f.index)])
                               for j, f in enumerate(fragments)]
        return pieces

    def write(self, monitor, samples: int) -> None:
        """Send the values of an export not yet reported to DeepSpeed's ``MonitorMaster``."""
        if self.events:
            monitor.write_events([(PREFIX + k, v, samples) for k, v in self.events.items()])
            self.events = {}
