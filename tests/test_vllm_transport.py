"""The receiver's shared-memory transport and its checks that need no engine."""
import os
import types

import pytest
import torch

from helpers import bits
from vllm_receiver import VllmReceiver
from vllm_receiver.transport import ALIGN, SharedBuffer, packed_size


def test_a_packed_update_reads_back_bit_for_bit_through_a_second_mapping():
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
               ("b", torch.randn(7, generator=g)),  # fp32
               ("i", torch.arange(11, dtype=torch.int32)),
               ("nan", torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)),
               ("fp8", torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn).view(torch.uint8))]
    buf = SharedBuffer.create(packed_size(tensors))
    try:
        specs = buf.pack(tensors)
        peer = SharedBuffer.open(buf.path, buf.size, buf.name)  # what the worker maps
    finally:
        buf.close()
    assert not os.path.exists(buf.path)  # closed: no process can open it any more, both mappings live on
    with pytest.raises(OSError, match="no shared buffer at /proc/"):  # and it is not created anew by opening it
        SharedBuffer.open(buf.path, buf.size, buf.name)
    assert all(s[3] % ALIGN == 0 for s in specs)
    for (name, t), spec in zip(tensors, specs):
        got = peer.view(spec)
        assert spec[0] == name and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(bits(got.reshape(-1)), bits(t.reshape(-1))), name
    peer.view(specs[0]).zero_()  # one memory: a write on one side is seen on the other
    assert not buf.view(specs[0]).any()


def test_a_buffer_is_mapped_only_as_the_memory_file_it_names(tmp_path):
    """Two buffers made one after the other may get one /proc/<pid>/fd path, never one name; the peer maps a path
    only as the faircast memory file of the name (and size) it is given, else refuses naming the path."""
    first = SharedBuffer.create(64)
    first.close()
    second = SharedBuffer.create(64)
    try:
        assert second.path == first.path and second.name != first.name  # the fd number is reused
        with pytest.raises(ValueError, match=f"refusing to map {second.path}"):
            SharedBuffer.open(second.path, 64, first.name)
        with pytest.raises(ValueError, match=f"refusing to map {second.path}"):
            SharedBuffer.open(second.path, 128, second.name)  # not the size it was made with
        file = tmp_path / "weights.bin"
        file.write_bytes(b"\x5a" * 64)
        fd = os.open(file, os.O_RDWR)
        try:
            for path in (str(file), f"/proc/{os.getpid()}/fd/{fd}"):
                with pytest.raises(ValueError, match=f"refusing to map {path}"):
                    SharedBuffer.open(path, 64, second.name)
        finally:
            os.close(fd)
        assert file.read_bytes() == b"\x5a" * 64
        assert SharedBuffer.open(second.path, 64, second.name).size == 64
    finally:
        second.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_non_finite_values_are_refused_naming_the_tensor_and_the_count(dtype):
    """The receiver's check before anything is written (load() and apply() call it): bf16, fp32 and FP8 E4M3, whose
    NaN is the bit pattern S.1111.111 (0x7f, 0xff) and which has no Inf (0x7e, 0xfe are +-448)."""
    from vllm_receiver import _check_finite
    if dtype == torch.float8_e4m3fn:
        ok = torch.tensor([0x00, 0x7E, 0xFE, 0x80], dtype=torch.uint8).view(dtype)
        bad = torch.tensor([0x7F, 0x01, 0xFF, 0x7E], dtype=torch.uint8).view(dtype)
    else:
        ok = torch.tensor([0.0, -0.0, 1e-40, torch.finfo(dtype).max], dtype=dtype)
        bad = torch.tensor([float("nan"), 1.0, float("inf"), float("-inf")], dtype=dtype)
    _check_finite("VllmReceiver.load", "w", ok)
    count = 2 if dtype == torch.float8_e4m3fn else 3
    with pytest.raises(ValueError, match=f"VllmReceiver.load: 'w' holds {count} non-finite values"):
        _check_finite("VllmReceiver.load", "w", bad)


def test_an_update_that_does_not_fit_raises():
    buf = SharedBuffer.create(64)
    buf.close()
    with pytest.raises(ValueError, match="do not fit the 64-byte shared buffer"):
        buf.pack([("w", torch.zeros(40, dtype=torch.bfloat16))])


def test_an_engine_without_the_worker_extension_is_refused_naming_it():
    """The check reads the engine's config (``llm.llm_engine.vllm_config.parallel_config``) before any RPC."""
    for ext in (None, "trl.scripts.vllm_serve.WeightSyncWorkerExtension"):
        llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(worker_extension_cls=ext))))
        with pytest.raises(ValueError, match="worker_extension_cls='vllm_receiver.extension.FairCastWorkerExtension'"):
            VllmReceiver(llm)
