"""The shared-memory transport between a trainer and a vLLM worker on one host.

One buffer, a file in ``/dev/shm`` (the host's RAM), is mapped once by both processes
(``torch.from_file(path, shared=True)``); an update copies its tensors into it and sends the engine only
``[name, dtype, shape, offset]`` per tensor, by name, to a worker extension method. No tensor and no code is
pickled, and the bytes move at memory speed (two copies: trainer -> buffer -> engine). The file is unlinked
as soon as the worker has mapped it, so nothing is left in ``/dev/shm`` when either process dies. The buffer is
sized to the largest update seen and reused; a larger update maps a larger one.

A *spec* is the JSON-able ``[name, dtype name, shape, byte offset]`` of one tensor in the buffer.
"""
from __future__ import annotations

import os
import tempfile
import uuid

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


def shm_dir() -> str:
    """``/dev/shm`` where the host has it (RAM-backed), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedBuffer:
    """A byte buffer in shared memory, mapped by this process (``create``) or by the peer (``open``).

    Attributes:
        path: the file both sides map (unlinked by :meth:`unlink` once the peer has mapped it).
        size: its size in bytes.
        data: uint8 tensor ``[size]`` over the mapping.
    """

    def __init__(self, path: str, size: int):
        self.path, self.size = path, int(size)
        self.data = torch.from_file(path, shared=True, size=self.size, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> "SharedBuffer":
        """A new zeroed buffer of ``size`` bytes (at least one alignment unit) in :func:`shm_dir`.

        Raises:
            OSError: the file cannot be created or sized (e.g. ``/dev/shm`` full), naming the path.
        """
        size = max(aligned(size), ALIGN)
        path = os.path.join(shm_dir(), f"faircast-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            with open(path, "wb") as f:
                f.truncate(size)
        except OSError as err:
            raise OSError(f"faircast: cannot create a {size}-byte shared buffer at {path}: {err}") from err
        return cls(path, size)

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); no error if it is gone."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def view(self, spec: Spec) -> torch.Tensor:
        """The tensor a spec names, as a view into the buffer (no copy)."""
        _, dtype, shape, offset = spec
        dt = getattr(torch, dtype)
        n = 1
        for d in shape:
            n *= int(d)
        return self.data.narrow(0, int(offset), n * dt.itemsize).view(dt).view(*shape)

    @torch.no_grad()
    def pack(self, tensors: list[tuple[str, torch.Tensor]]) -> list[Spec]:
        """Copy ``(name, tensor)`` pairs into the buffer, one after another (aligned); returns their specs.

        Raises:
            ValueError: they do not fit (see :func:`packed_size`).
        """
        specs, offset = [], 0
        for name, t in tensors:
            n = nbytes(t)
            if offset + n > self.size:
                raise ValueError(f"faircast: {packed_size(tensors)} bytes do not fit the {self.size}-byte shared buffer")
            spec = [name, dtype_name(t.dtype), list(t.shape), offset]
            self.view(spec).copy_(t)
            specs.append(spec)
            offset += aligned(n)
        return specs


def packed_size(tensors) -> int:
    """Bytes :meth:`SharedBuffer.pack` needs for ``(name, tensor)`` pairs."""
    return sum(aligned(nbytes(t)) for _, t in tensors)
