"""Drift telemetry: how far the served bf16 (and FP8) weights are from the fp32 master (docs/design.md).

* ``changed_fraction[t]`` — fraction of served bf16 elements whose bits differ from step t-1.
* ``lag_steps[t]``       — argmin over k in [0, K] of ||served_t - master_{t-k}||^2 on a fixed
  random sample of elements: how old the served policy looks.
* ``gap_ulps[t]``        — mean |served - master| in units of the local bf16 spacing.
* :func:`logprob_gap`    — mean |log p_master - log p_served| per token and KL(master || served).

The functions below measure whole tensors on the host (tests, demos). Inside training,
:class:`DriftSample` measures the elements a rank casts on their device, on a fixed sample chosen
by global element index (so the sample is the same in every layout), and :func:`reduce_drift`
turns the ranks' sums into the four numbers the integrations log, with one small all-reduce.
Both integrations' exports call an :class:`ExportObserver` at every export (the default one does
nothing); :class:`DriftObserver` is the one that measures.
"""
from __future__ import annotations

import contextlib
import time
import zlib
from collections import deque
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
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


def e4m3_spacing(y: torch.Tensor) -> torch.Tensor:
    """The E4M3 grid's spacing at each element of the float32 tensor ``y`` (a master over its FP8 scale), as float32:
    ``2**(max(e, -6) - 3)`` for |y| in [2**e, 2**(e+1)), that of the top binade (32) at and above 448. NaN/Inf give
    NaN."""
    a = torch.clamp(y.float().abs(), max=448.0)
    e = torch.clamp((a.view(torch.int32) >> 23) - 127, min=-6)
    spacing = torch.ldexp(torch.ones_like(a), e - 3)
    return torch.where(torch.isfinite(y), spacing, torch.nan)


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
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.index = torch.randint(numel, (sample_size,), generator=g, device="cpu").sort().values
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


# -- on-device telemetry of a sharded export ---------------------------------------------------------
def sample_stride(total: int, sample: int = 65536) -> int:
    """Sampling stride for a model of ``total`` elements: about ``sample`` elements are watched.

    Returns the smallest prime >= ceil(total / sample) (1 when ``total <= sample``: every element).
    A prime keeps the sample from lining up with the columns of a weight matrix.

    Raises:
        ValueError: ``total < 0`` or ``sample <= 0``.
    """
    if total < 0 or sample <= 0:
        raise ValueError(f"sample_stride needs total >= 0 and sample > 0, got {total=}, {sample=}")
    n = max(1, -(-total // sample))
    while n > 2 and any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def sampled_positions(rows: Iterable[Sequence], stride: int, device=None,
                      with_index: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffer positions of the sampled elements of a buffer's param fragments.

    Element ``g`` (global flat index) of param ``name`` is sampled when
    ``(g + crc32(name)) % stride == 0``: a choice that depends only on the element, never on the
    layout, so every layout watches the same elements and a test can recompute the numbers from
    the gathered model.

    Args:
        rows: ``(name, start, numel, index)`` per fragment (as for ``FairCaster.cast_flat``):
            canonical param name, offset in the buffer, element count, global index of its first
            element.
        stride: from :func:`sample_stride` (>= 1).
        device: where the returned tensor lives.

        with_index: also return each sampled element's global index and row number.

    Returns:
        int64 ``[n]``, sorted by row then position (``with_index``: ``(positions, global indices, rows)``).
    """
    parts, which = [], []
    for r, (name, start, numel, index) in enumerate(rows):
        skip = -(int(index) + zlib.crc32(name.encode())) % stride  # first sampled element of the row
        if skip < numel:
            parts.append(torch.arange(int(start) + skip, int(start) + int(numel), stride, dtype=torch.int64,
                                      device=device))
            which.append(torch.full_like(parts[-1], r))
    pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    if not with_index:
        return pos
    row = torch.cat(which) if which else torch.zeros(0, dtype=torch.int64, device=device)
    start_index = torch.tensor([[int(start), int(index)] for _, start, _, index in rows] or [[0, 0]],
                               dtype=torch.int64, device=device)
    return pos, pos - start_index[row, 0] + start_index[row, 1], row


class DriftSample:
    """Drift telemetry of the elements one rank casts, measured on their device (no host copy).

    Call :meth:`observe` once per whole-model export with every piece this rank should count
    (a replica that another rank also casts is left out by the caller, so that each element
    counts once over all ranks). It keeps, on the pieces' device, the served bits and the master
    of the sampled elements (``max_lag + 1`` past master samples) and leaves in :attr:`last` the
    sums :func:`reduce_drift` needs. Nothing crosses to the host. :meth:`prime`, before the first
    export, gives the first ``changed_fraction`` the served model it starts from.

    With ``fp8`` (an :class:`~faircast_dist.fp8.Fp8Export`) it measures the FP8 served copy instead: pieces hold
    the uint8 E4M3 bits (and only FP8 params' runs), the served value is ``q * scale`` and the gap is in units of
    the E4M3 spacing times the scale.

    Args:
        stride: sampling stride (:func:`sample_stride`, the same on every rank).
        max_lag: K, past master samples kept for ``lag_steps``.
        fp8: the FP8 export whose served copy is measured (its scales at each :meth:`observe`), or None (bf16).

    Attributes:
        last: float64 ``[4 + K + 1]`` on the pieces' device, or None before the first export:
            ``[changed elements, sampled elements, sum of |served - master| in ulps, finite
            masters, ||served - master_{t-k}||^2 for k = 0..K]`` (0 beyond the history).
        steps: exports observed (int).
    """

    def __init__(self, stride: int, max_lag: int = 100, fp8=None):
        if stride < 1 or max_lag < 0:
            raise ValueError(f"DriftSample needs stride >= 1 and max_lag >= 0, got {stride=}, {max_lag=}")
        self.stride, self.max_lag, self.fp8 = stride, max_lag, fp8
        self.positions: dict = {}
        self.ring: torch.Tensor | None = None  # [K + 1, n] float32 master samples, row head = now
        self.head = -1
        self.previous: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.steps = 0

    def _positions(self, rows, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled positions of a piece's ``rows`` and (FP8) each one's index into the flat scales."""
        if self.fp8 is None:
            return sampled_positions(rows, self.stride, device), None
        pos, g, row = sampled_positions(rows, self.stride, device, with_index=True)
        scale = torch.zeros_like(pos)
        offsets = self.fp8.scale_offsets()
        for r, (name, *_) in enumerate(rows):
            at = row == r
            scale[at] = offsets[name] + self.fp8.rule.scale_index(self.fp8.shapes[name], g[at])
        return pos, scale

    def _select(self, pieces: Iterable[tuple], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampled masters (float32), served bits (bf16 as int16; FP8: uint8) and (FP8) flat scale indices of
        ``pieces``, on the served device."""
        masters, served, scales = [], [], []
        for key, master, out, rows in pieces:
            device = out.device  # the served side (ZeRO-Offload: masters on the host)
            pos = self.positions.get(key)
            if pos is None:
                p, scale = self._positions(rows, device)
                pos = self.positions[key] = (p.to(master.device), p, scale)
            masters.append(master.index_select(0, pos[0]).to(device))
            served.append(out.index_select(0, pos[1]))
            if pos[2] is not None:
                scales.append(pos[2])
        m = torch.cat(masters) if masters else torch.zeros(0, dtype=torch.float32, device=device)
        dtype = torch.bfloat16 if self.fp8 is None else torch.uint8
        s = torch.cat(served) if served else torch.zeros(0, dtype=dtype, device=device)
        scale = torch.cat(scales) if scales else torch.zeros(0, dtype=torch.int64, device=device)
        return m, s.view(torch.int16) if self.fp8 is None else s, scale

    def reset(self) -> None:
        """Forget the served bits and master history (after a checkpoint load in a running
        process): the next export is primed again and the lag history restarts."""
        self.previous = self.last = self.ring = None
        self.head, self.steps = -1, 0

    @torch.no_grad()
    def prime(self, pieces: Iterable[tuple], device=None) -> None:
        """Record the served bits before the first export (the model as initialised or loaded
        from a checkpoint), so that the first ``changed_fraction`` counts the change from them:
        a resumed run then reports what the uninterrupted run does (``lag_steps`` still needs
        ``max_lag`` exports of history). Call it before the first export's cast, with the pieces
        :meth:`observe` will get (their served buffers not yet written). Without it the first
        export reports 0 changed.
        """
        self.previous = self._select(pieces, device)[1].clone()

    @torch.no_grad()
    def observe(self, pieces: Iterable[tuple], device=None) -> None:
        """Measure one export.

        Args:
            pieces: ``(key, master, served, rows)``: a hashable key naming the buffer (the
                same key must mean the same buffer at every export), its float32 1-D master
                buffer, the bfloat16 1-D buffer served from it (same length and device) and its
                fragments ``(name, start, numel, index)`` (positions are computed once per key).
            device: where :attr:`last` lives when there are no pieces (default: CPU).
        """
        m, bits, scale_index = self._select(pieces, device)
        if self.fp8 is None:
            served, spacing = bits.view(torch.bfloat16).float(), bf16_spacing(m)
        else:  # q * scale, and the E4M3 spacing at the master, times the scale
            scale = self.fp8.flat_scales(m.device)[scale_index]
            served, spacing = bits.view(torch.float8_e4m3fn).float() * scale, e4m3_spacing(m / scale) * scale
        last = torch.zeros(5 + self.max_lag, dtype=torch.float64, device=m.device)
        if self.previous is not None and self.previous.shape == bits.shape:
            last[0] = (self.previous != bits).sum()
        last[1] = bits.numel()
        finite = torch.isfinite(m)
        last[2] = torch.where(finite, (served - m).abs() / spacing, 0).double().sum()
        last[3] = finite.sum()
        if self.ring is None or self.ring.shape[1] != m.numel():
            self.ring, self.head = torch.zeros(self.max_lag + 1, m.numel(), dtype=torch.float32, device=m.device), -1
        self.head = (self.head + 1) % (self.max_lag + 1)
        self.ring[self.head] = m
        d = (self.ring - served) ** 2
        rows = torch.where(torch.isfinite(d), d, 0).double().sum(1)  # by ring row
        age = (self.head - torch.arange(self.max_lag + 1, device=m.device)) % (self.max_lag + 1)
        last[4:] = rows[age]  # k = 0 is now
        self.previous, self.last = bits.clone(), last
        self.steps += 1


def reduce_drift(samples: Sequence[DriftSample], export_ms: float = 0.0, group=None) -> dict[str, float]:
    """The drift numbers of one export over all ranks, from every rank's :class:`DriftSample`.

    Collective over ``group`` when torch.distributed is initialised (two all-reduces of a
    ``K + 5`` float64 vector and of one float, on the samples' device); every rank gets the same
    values. The samples (e.g. one per leaf optimizer) must have observed the same exports.

    Args:
        samples: this rank's samples (may be empty on a rank that casts nothing, but then it must
            still call with the same ``max_lag`` as ``samples`` elsewhere: pass them anyway).
        export_ms: this rank's export time; the slowest rank's is reported.
        group: the process group (None: the default group).

    Returns:
        ``{"changed_fraction": 0..1, "lag_steps": int in [0, K], "gap_ulps": >= 0, "export_ms": ms}``.

    Raises:
        ValueError: no samples, or samples that have not observed an export / disagree on K.
    """
    if not samples or any(s.last is None for s in samples):
        raise ValueError("reduce_drift needs DriftSamples that have observed an export")
    if len({s.last.numel() for s in samples}) != 1 or len({s.steps for s in samples}) != 1:
        raise ValueError("reduce_drift: the samples disagree on max_lag or on the number of exports")
    total = torch.stack([s.last for s in samples]).sum(0)
    ms = torch.tensor([export_ms], dtype=torch.float64, device=total.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    v = total.tolist()
    history = min(samples[0].steps, samples[0].max_lag + 1)
    dists = v[4:4 + history]
    return {"changed_fraction": v[0] / v[1] if v[1] else 0.0,
            "lag_steps": min(range(history), key=dists.__getitem__),
            "gap_ulps": v[2] / v[3] if v[3] else 0.0,
            "export_ms": ms.item()}


class ExportTimer:
    """Wall time of an export on its device, without a host sync when it is taken.

    An export may be cast in several spans with other work between them (DeepSpeed ZeRO-1/2 and
    ZeRO-3 cast each param group right after stepping it): :meth:`start` with ``new=False`` opens
    another span of the same export, and :meth:`ms` sums the spans, so the optimizer's own work
    between them is not counted.

    CUDA: a pair of ``torch.cuda.Event`` per span (read at :meth:`ms`, which waits for the last
    end event); other devices: ``time.perf_counter``.
    """

    def __init__(self):
        self._spans: list[list] = []  # [start, end or None] per span of the current export

    def start(self, device, new: bool = True) -> None:
        """Open a span on ``device`` (a ``torch.device``); ``new``: of a new export (the spans of
        the previous one are dropped), else of the current one."""
        if new:
            self._spans = []
        if torch.device(device).type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            begin = time.perf_counter()
        self._spans.append([begin, None])

    def stop(self) -> None:
        """Close the span opened last (nothing when it is closed already or none was opened)."""
        if self._spans and self._spans[-1][1] is None:
            span = self._spans[-1]
            if isinstance(span[0], float):
                span[1] = time.perf_counter()
            else:
                span[1] = torch.cuda.Event(enable_timing=True)
                span[1].record()

    def ms(self) -> float:
        """Milliseconds in the closed spans of the current export (0.0 before any)."""
        spans = [s for s in self._spans if s[1] is not None]
        if not spans:
            return 0.0
        if isinstance(spans[0][0], float):
            return 1e3 * sum(end - begin for begin, end in spans)
        spans[-1][1].synchronize()
        return float(sum(begin.elapsed_time(end) for begin, end in spans))


# -- the observer both integrations' exports call ------------------------------------------------------
class ExportObserver:
    """Telemetry of a rank's exports, as both integrations call it at every export, unconditionally.
    This base class is the default: no telemetry, no cost.

    An export calls :meth:`begin` once before its first cast, casts inside one or more
    :meth:`span` blocks (DeepSpeed casts each param group right after stepping it: the optimizer's
    own work in between is not timed), then calls :meth:`end` when the export is complete;
    ``pieces`` is a callable returning the :meth:`DriftSample.observe` pieces of the buffers this
    rank counts (called only by an observer that measures, so the default costs nothing).
    :meth:`reset` after a checkpoint load in a running process (the served model was replaced).
    """

    def begin(self, pieces) -> None:
        """An export is about to cast (nothing served has been written yet)."""

    def span(self, device):
        """A context manager around one cast of the export, on ``device``."""
        return contextlib.nullcontext()

    def end(self, pieces) -> None:
        """The export is complete."""

    def fp8_begin(self, fp8, pieces) -> None:
        """FP8 served weights (``format "fp8"``): ``fp8`` (the :class:`~faircast_dist.fp8.Fp8Export`) is about to
        cast an export (what ``pieces`` returns is what the last one served, when ``fp8.scales`` is not empty)."""

    def fp8(self, fp8, pieces) -> None:
        """FP8 served weights (``format "fp8"``): ``fp8`` (the :class:`~faircast_dist.fp8.Fp8Export`) has just cast
        its export; ``fp8.last_rescales`` scales were set again (after their first: each a dense update of its
        channel or block; the same count on every rank). ``pieces`` returns the FP8 pieces this rank counts
        (``(key, master, uint8 E4M3 bits, FP8 runs)``), called only by an observer that measures."""

    def reset(self) -> None:
        """Forget the served model and history: the next export starts afresh."""


class DriftObserver(ExportObserver):
    """Drift telemetry of a rank's exports: a :class:`DriftSample` and an :class:`ExportTimer`.

    Args:
        stride: sampling stride (:func:`sample_stride` of the whole model, the same on every rank).
        max_lag: K, past master samples kept for ``lag_steps``.
        device: where the sums live when this rank casts nothing (default: CPU).

    Attributes:
        sample: the :class:`DriftSample` (its ``last`` is what :func:`reduce_drift` reduces).
        timer: the :class:`ExportTimer` of the spans of the last export.
    """

    def __init__(self, stride: int, max_lag: int = 100, device=None):
        self.sample, self.timer, self.device = DriftSample(stride, max_lag), ExportTimer(), device
        self._new = True
        self.rescales: int | None = None  # FP8: the last export's
        self.fp8_sample: DriftSample | None = None  # FP8: the served FP8 copy's, from its first export

    def begin(self, pieces) -> None:
        if self.sample.previous is None:  # the first export (of this run or since a resume)
            self.sample.prime(pieces(), device=self.device)  # the served model this export replaces
        self._new = True

    @contextlib.contextmanager
    def span(self, device):
        self.timer.start(device, new=self._new)
        self._new = False
        try:
            yield
        finally:
            self.timer.stop()

    def end(self, pieces) -> None:
        self.sample.observe(pieces(), device=self.device)

    def _fp8(self, fp8) -> DriftSample:
        if self.fp8_sample is None:
            self.fp8_sample = DriftSample(self.sample.stride, self.sample.max_lag, fp8=fp8)
        return self.fp8_sample

    def fp8_begin(self, fp8, pieces) -> None:
        if self._fp8(fp8).previous is None and fp8.scales:  # an earlier export (install, a load) served these bits
            self.fp8_sample.prime(pieces(), device=self.device)

    def fp8(self, fp8, pieces) -> None:
        self.rescales = fp8.last_rescales
        self._fp8(fp8).observe(pieces(), device=self.device)

    def reset(self) -> None:
        self.sample.reset()
        if self.fp8_sample is not None:
            self.fp8_sample.reset()

    def reduce(self, group=None) -> dict[str, float]:
        """:func:`reduce_drift` of this rank's sample and export time (collective), and with FP8 served weights
        (:func:`reduce_fp8`) the FP8 copy's numbers, prefixed ``fp8_``, and ``fp8_rescales``."""
        drift = reduce_drift([self.sample], self.timer.ms(), group=group)
        return {**drift, **reduce_fp8([self], group)}


def reduce_fp8(observers: Sequence[DriftObserver], group=None) -> dict[str, float]:
    """The FP8 served copy's drift over all ranks (collective, like :func:`reduce_drift`, when the observers have
    seen an FP8 export; else ``{}`` on every rank): ``fp8_changed_fraction`` (sampled E4M3 elements whose bits
    changed), ``fp8_lag_steps``, ``fp8_gap_ulps`` (mean |q * scale - master| in E4M3 spacings times the scale)
    and ``fp8_rescales`` (the scales set again at the last export, summed over ``observers``: one per
    optimizer)."""
    samples = [o.fp8_sample for o in observers if o.fp8_sample is not None and o.fp8_sample.last is not None]
    if not samples:
        return {}
    drift = reduce_drift(samples, group=group)
    return {"fp8_changed_fraction": drift["changed_fraction"], "fp8_lag_steps": drift["lag_steps"],
            "fp8_gap_ulps": drift["gap_ulps"], "fp8_rescales": float(sum(o.rescales or 0 for o in observers))}
