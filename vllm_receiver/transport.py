"""The shared-memory transport between a trainer and a vLLM worker on one host.

One buffer, an anonymous memory file (``memfd_create``) of the trainer, is mapped once by both processes: the
worker opens it through ``/proc/<trainer pid>/fd/<fd>`` while the trainer holds the descriptor, and the trainer
closes the descriptor once both have mapped it. No name is ever made in a file system, so nothing is left behind
when either process dies, however it dies. Each buffer has a name of its own, ``faircast-buffer-<random id>``, the
memory file's name: the worker maps a path only as the memory file of the name it is given
(:meth:`SharedBuffer.open`) and knows the buffer by that name, not by its path (a descriptor's number, and so its
path, is reused once closed: two receivers of one process may hand the worker one path). An update copies its
tensors into the buffer and sends the engine only ``[name, dtype, shape, offset]`` per tensor, by name, to a
worker extension method: no tensor and no code is pickled, and the bytes move at memory speed (two copies:
trainer -> buffer -> engine). The buffer is sized to the largest update seen and reused; a larger update maps a
larger one. Linux only (``memfd_create``, ``/proc``), as vLLM's CPU backend.

A *spec* is the JSON-able ``[name, dtype name, shape, byte offset]`` of one tensor in the buffer.
"""
from __future__ import annotations

import math
import os
import re
import secrets
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
    """A byte buffer in shared memory, made by this process (:meth:`create`) or mapped from the peer's
    (:meth:`open`).

    Attributes:
        path: ``/proc/<pid>/fd/<fd>`` of the creating process: what the peer opens, while :meth:`close` has not
            been called.
        name: ``faircast-buffer-<random id>``, the memory file's name: what names the buffer in the worker.
        size: its size in bytes.
        data: uint8 tensor ``[size]`` over the mapping.
    """

    def __init__(self, path: str, size: int, name: str, fd: int):
        """Map the memory file open as ``fd`` (internal: see :meth:`create` and :meth:`open`)."""
        self.path, self.size, self.name, self.fd = path, int(size), name, None
        self.data = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=self.size, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> "SharedBuffer":
        """A new zeroed buffer of ``size`` bytes (at least one alignment unit), an anonymous memory file of a new
        name; this process holds its descriptor until :meth:`close`.

        Raises:
            OSError: it cannot be made or sized (out of memory), naming the size.
        """
        size, name = max(aligned(size), ALIGN), f"faircast-buffer-{secrets.token_hex(16)}"
        try:
            fd = os.memfd_create(name)
            os.ftruncate(fd, size)
        except OSError as err:
            raise OSError(f"faircast: cannot make a {size}-byte shared buffer: {err}") from err
        buffer = cls(f"/proc/{os.getpid()}/fd/{fd}", size, name, fd)
        buffer.fd = fd
        return buffer

    @classmethod
    def open(cls, path: str, size: int, name: str) -> "SharedBuffer":
        """Map the peer's buffer ``name`` of ``size`` bytes at ``path`` (read-write). Anything else is refused
        before it is mapped: ``path`` must be ``/proc/<pid>/fd/<fd>`` of an anonymous memory file named ``name``
        (``faircast-buffer-<id>``, as :meth:`create` names it) of ``size`` bytes, checked on the file opened.

        Raises:
            ValueError: ``path`` is not that buffer (a file, another memory file or buffer, another size), naming it.
            OSError: ``path`` cannot be opened (its creator closed it, or died), naming it.
        """
        def refuse(what: str) -> ValueError:
            return ValueError(f"faircast: refusing to map {path}: {what}, not the shared buffer {name!r} of {size} "
                              f"bytes (an anonymous memory file of the trainer's, /proc/<pid>/fd/<fd>)")
        memfd = f"/memfd:{name} (deleted)"  # how /proc shows a memory file (never linked into a file system)
        if not re.fullmatch(r"/proc/[0-9]+/fd/[0-9]+", str(path)) or \
                not re.fullmatch(r"faircast-buffer-[0-9a-f]{32}", str(name)):
            raise refuse("not a faircast buffer's path and name")
        try:
            target = os.readlink(path)  # checked before it is opened (opening a device may act), and once open
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC) if target == memfd else None
        except FileNotFoundError as err:
            raise OSError(f"faircast: no shared buffer at {path} (its creator closed it or exited)") from err
        if fd is None:
            raise refuse(f"it is {target!r}")
        try:
            target, found = os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size
            if target != memfd or found != int(size):
                raise refuse(f"it is {target!r} of {found} bytes")
            return cls(path, size, name, fd)
        finally:
            os.close(fd)  # the mapping stays

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
