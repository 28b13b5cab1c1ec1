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
        peer = SharedBuffer(buf.path, buf.size)  # what the worker maps
    finally:
        buf.close()
    assert not os.path.exists(buf.path)  # closed: no process can open it any more, both mappings live on
    with pytest.raises(OSError, match="no shared buffer at /proc/"):  # and it is not created anew by opening it
        SharedBuffer(buf.path, buf.size)
    assert all(s[3] % ALIGN == 0 for s in specs)
    for (name, t), spec in zip(tensors, specs):
        got = peer.view(spec)
        assert spec[0] == name and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(bits(got.reshape(-1)), bits(t.reshape(-1))), name
    peer.view(specs[0]).zero_()  # one memory: a write on one side is seen on the other
    assert not buf.view(specs[0]).any()


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
