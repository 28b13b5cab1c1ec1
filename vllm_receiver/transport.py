"""The shared-memory transport between a trainer and a vLLM worker on one host.

One buffer, an anonymous memory file (``memfd_create``) of the trainer, is mapped once by both processes: the
worker opens it through ``/proc/<trainer pid>/fd/<fd>`` while the trainer holds the descriptor
(``torch.from_file(path, shared=True)``), and the trainer closes the descriptor once both have mapped it. No name
is ever made in a file system, so nothing is left behind when either process dies, however it dies. An update
copies its tensors into the buffer and sends the engine only ``[name, dtype, shape, offset]`` per tensor, by name,
to a worker extension method: no tensor and no code is pickled, and the bytes move at memory speed (two copies:
trainer -> buffer -> engine). The buffer is sized to the largest update seen and reused; a larger update maps a
larger one. Linux only (``memfd_create``, ``/proc``), as vLLM's CPU backend.

A *spec* is the JSON-able ``[name, dtype name, shape, byte offset]`` of one tensor in the buffer.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

#: tensors start on cache-line boundaries in the buffer (bytes)
ALIGN = 64

Spec = list  # [name: str, dtype: str, shape: list[int], offset: int]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how a spec names a dtype)."""
    return str(dtype).removeprefix("torch.")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedBuffer:
    """A byte buffer in shared memory, made by this process (:meth:`create`) or mapped from the peer's ``path``.

    Attributes:
        path: ``/proc/<pid>/fd/<fd>`` of the creating process: what the peer opens, while :meth:`close` has not
            been called; it also names the buffer in the worker.
        size: its size in bytes.
        data: uint8 tensor ``[size]`` over the mapping.

    Raises:
        OSError: the path cannot be opened (its creator closed it, or died), naming it.
    """

    def __init__(self, path: str, size: int, fd: int | None = None):
        self.path, self.size, self.fd = path, int(size), fd
        if not os.path.exists(path):  # torch.from_file would create it
            raise OSError(f"faircast: no shared buffer at {path} (its creator closed it or exited)")
        self.data = torch.from_file(path, shared=True, size=self.size, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> "SharedBuffer":
        """A new zeroed buffer of ``size`` bytes (at least one alignment unit), an anonymous memory file.

        Raises:
            OSError: it cannot be made or sized (out of memory), naming the size.
        """
        size = max(aligned(size), ALIGN)
        try:
            fd = os.memfd_create("faircast-buffer")
            os.ftruncate(fd, size)
        except OSError as err:
            raise OSError(f"faircast: cannot make a {size}-byte shared buffer: {err}") from err
        return cls(f"/proc/{os.getpid()}/fd/{fd}", size, fd)

    def close(self) -> None:
        """Close the creator's descriptor once the peer has mapped the buffer (both mappings stay valid); after
        this no other process can open it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def view(self, spec: Spec) -> torch.Tensor:
        """The tensor a spec names, as a view into the buffer (no copy)."""
        _, dtype, shape, offset = spec
        dt = getattr(torch, dtype)
        return self.data.narrow(0, int(offset), math.prod(shape) * dt.itemsize).view(dt).view(*shape)

    @torch.no_grad()
    def pack(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Spec]:
        """Copy ``(name, tensor)`` pairs into the buffer, one after another (aligned), as they come; returns their
        specs.

        Raises:
            ValueError: they do not fit (see :func:`packed_size`).
        """
        specs, offset = [], 0
        for name, t in tensors:
            n = nbytes(t)
            if offset + n > self.size:
                raise ValueError(f"faircast: the update's tensors do not fit the {self.size}-byte shared buffer "
                                 f"({name!r} would end at byte {offset + n})")
            spec = [name, dtype_name(t.dtype), list(t.shape), offset]
            self.view(spec).copy_(t)
            specs.append(spec)
            offset += aligned(n)
        return specs


def packed_size(tensors) -> int:
    """Bytes :meth:`SharedBuffer.pack` needs for ``(name, tensor)`` pairs."""
    return sum(aligned(nbytes(t)) for _, t in tensors)
