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

from deepspeed.accelerator import get_accelerator

from faircast_dist.telemetry import DriftObserver, sample_stride

PREFIX = "Train/Samples/export_cast/"


class DriftMonitor(DriftObserver):
    """The export's telemetry observer when DeepSpeed's monitor is enabled (see module doc): a
    :class:`~faircast_dist.telemetry.DriftObserver` that reduces every export's numbers (collective)
    and hands them to the monitor.

    Args:
        total: elements in the whole model (the same on every rank).
        sample: about how many of them to watch.
        max_lag: K, past master samples kept.

    Attributes:
        events: the values of the last export not yet written (``{name: float}``).
    """

    def __init__(self, total: int, sample: int = 65536, max_lag: int = 100):
        super().__init__(sample_stride(total, sample), max_lag, device=get_accelerator().current_device_name())
        self.events: dict[str, float] = {}

    def end(self, pieces) -> None:
        """Measure the export just finished and reduce it over all ranks (collective)."""
        super().end(pieces)
        self.events = self.reduce()

    def write(self, monitor, samples: int) -> None:
        """Send the values of an export not yet reported to DeepSpeed's ``MonitorMaster``."""
        if self.events:
            monitor.write_events([(PREFIX + k, v, samples) for k, v in self.events.items()])
            self.events = {}
