"""What the tests share: raw bits, a free port for a spawned process group, Fair Cast's warnings."""
from __future__ import annotations

import contextlib
import logging
import socket

import torch

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a floating-point tensor as the integer dtype of its width (bf16 / fp16 -> int16,
    fp32 -> int32, fp8 -> int8), same shape; any other tensor as it is. Equal bits, not equal values:
    -0.0 differs from 0.0 and a NaN payload counts."""
    return t.view(_INTS[t.element_size()]) if t.is_floating_point() else t


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def logged_warnings():
    """The messages Fair Cast logs on its warning channel (``logging.getLogger("faircast")``, every
    adapter's) meanwhile: a list, filled as they come."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    handler, log = Collect(logging.WARNING), logging.getLogger("faircast")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def reference_fp8(config, snapshots, scales: dict | None = None) -> list[dict]:
    """The single-process reference of FP8 served weights (``format "fp8"``), from the spec functions on whole
    params: per snapshot (``{"step": int, "masters": {name: full fp32 master}}``, one per export, in order), the
    sticky scales from each whole tensor's absmax and the cast of each FP8 param; error feedback carries its fp32
    residual from export to export (zero at the first).

    ``scales``: ``{param name: float32 scales}`` kept before the first snapshot (a loaded checkpoint's), else none.

    Returns:
        per snapshot ``{name: float8_e4m3fn weight, scale name: float32 scales}`` of the FP8 params.
    """
    from faircast_dist import ExportCastConfig, FairCaster, fp8, rounding
    config = ExportCastConfig.from_value(config)
    caster = FairCaster(config)
    layout = fp8.Fp8Layout(config.fp8_scales, config.fp8_ue8m0)
    scales, residual, out = dict(scales or {}), {}, []
    for snap in snapshots:
        caster.step = snap["step"]
        served = {}
        for name, master in snap["masters"].items():
            if not fp8.fp8_param(config, name, tuple(master.shape)):
                continue
            x, shape = master.reshape(-1).float(), tuple(master.shape)
            r = residual.setdefault(name, torch.zeros_like(x))
            y = x + r if caster.method == "error_feedback" else x.bfloat16().float() if config.fp8_via_bf16 else x
            index = layout.scale_index(shape, 0, x.numel())
            absmax = fp8.partial_absmax(y, index, index.max().item() + 1).view(layout.scale_shape(shape))
            scales[name], _ = fp8.sticky_scales(layout, scales.get(name), absmax)
            s = fp8.element_scales(scales[name], index)
            if caster.method in ("stochastic", "dithered"):
                q = rounding.cast_fp8_stochastic(x, s, caster.key(name), 0)
            elif caster.method == "error_feedback":
                q = rounding.cast_fp8_error_feedback(x, s, r)
            else:
                q = rounding.cast_fp8_nearest(x, s, via_bf16=config.fp8_via_bf16)
            served[name] = q.view(shape)
            served[name[:-len("weight")] + layout.scale_name] = scales[name].clone()
        out.append(served)
    return out
