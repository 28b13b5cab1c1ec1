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
