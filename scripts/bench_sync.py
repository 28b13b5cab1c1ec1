"""A weight sync into a running vLLM engine, side by side in one run: the receiver's shared-memory path, the pickled
path it replaced, and a memcpy of the same bytes.

    python scripts/bench_sync.py [--layers 3] [--hidden 1024] [--repeats 5]

One engine (vLLM's CPU backend, one worker) serves a random Llama of about 100 MiB in bf16 (defaults). Rows:

* ``memcpy``: ``dst.copy_(src)`` of the full update's bytes in this process (the bandwidth reference);
* ``full, transport only``: the shared-memory transport alone: copy every tensor into the buffer, one RPC by name,
  the worker copies them out (no layer rebuilt: what any load costs at the least);
* ``full, shared memory``: ``VllmReceiver.load`` of every tensor (the transport, then the worker's in-place reload,
  which rebuilds every layer and, on AVX512-BF16/AMX hosts, repacks its weight for the GEMM kernel);
* ``full, pickled function``: the same tensors inside a pickled ``functools.partial`` through
  ``collective_rpc`` into the same reload (the receiver's transport before; needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which this script sets for its engine);
* ``delta, one tensor`` / ``delta, 0.5% everywhere``: ``VllmReceiver.apply`` of a delta touching one MLP weight,
  and one touching 0.5% of every tensor's elements, with the bytes sent into the engine (the touched layers,
  whole, where the CPU backend repacked the weights; only the changed elements where it computes from them).

Each row is the median of ``--repeats`` runs; MB are 10**6 bytes of payload (what the sender hands over); ``x memcpy``
is the row's MB/s over memcpy's. The host's ISA decides the CPU backend's GEMM (AVX512-BF16/AMX: repacked
weights), so the script prints the CPU flags that matter.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the pickled-function row only: the receiver itself sends no code and needs none of this
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
# the engine's worker imports BenchExtension from this file
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", "")

from vllm_receiver.extension import FairCastWorkerExtension  # noqa: E402  (after the variables it must see)
from vllm_receiver.transport import packed_size  # noqa: E402


class BenchExtension(FairCastWorkerExtension):
    """The receiver's worker side plus one method for the transport row: copy the tensors out of the shared buffer
    into tensors of the worker's own (what an engine load copies at the least), without rebuilding any layer."""

    def faircast_bench_copy(self, buffer: str, specs: list) -> int:
        buf, dst = self._faircast_buffer(buffer), self.__dict__.setdefault("_bench_dst", {})
        for spec in specs:
            src = buf.view(spec)
            dst.setdefault(spec[0], torch.empty_like(src)).copy_(src)
        return len(specs)


def _pickled_push(worker, weights):
    """The transport before: the tensors travel inside this function's pickled arguments."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def isa() -> str:
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return " ".join(sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))) or "?"


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM

    from vllm_receiver import VllmReceiver

    h = args.hidden
    config = LlamaConfig(vocab_size=8192, hidden_size=h, intermediate_size=int(2.75 * h), num_hidden_layers=args.layers,
                         num_attention_heads=h // 128, num_key_value_heads=h // 128, max_position_embeddings=256)
    path = tempfile.mkdtemp(prefix="faircast-bench-sync-")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
              worker_extension_cls="bench_sync.BenchExtension")
    receiver = VllmReceiver(llm)
    full = [(n, t.clone()) for n, t in receiver.weights.items()]
    payload = sum(t.numel() * t.element_size() for _, t in full)
    src = torch.cat([t.reshape(-1) for _, t in full])
    dst = torch.empty_like(src)

    rows = [("memcpy", payload, timed(lambda: dst.copy_(src), args.repeats), payload)]

    def transport():
        specs = receiver._reserve(packed_size(full)).pack(full)
        receiver._rpc("faircast_bench_copy", receiver.buffer.name, specs)
    rows.append(("full, transport only (copy in, RPC, copy out)", payload, timed(transport, args.repeats), payload))

    def load():
        before = receiver.totals["engine_bytes"]
        receiver.load(full)
        return receiver.totals["engine_bytes"] - before
    engine_bytes = load()
    rows.append(("full, shared memory", payload, timed(load, args.repeats), engine_bytes))
    rows.append(("full, pickled function", payload,
                 timed(lambda: llm.collective_rpc(functools.partial(_pickled_push, weights=full)), args.repeats),
                 payload))

    g = torch.Generator().manual_seed(1)
    mlp = next(n for n, _ in full if n.endswith("mlp.down_proj.weight"))
    for label, names, fraction in (("delta, one tensor", [mlp], 0.005), ("delta, 0.5% everywhere", None, 0.005)):
        deltas = []
        for n, t in full:
            if names is not None and n not in names:
                continue
            k = max(1, int(t.numel() * fraction))
            index = torch.randperm(t.numel(), generator=g)[:k].sort().values.to(torch.int32)
            deltas.append((n, index, (t.reshape(-1)[index].float() + 0.01).to(torch.bfloat16)))
        size = sum(i.numel() * 4 + v.numel() * 2 for _, i, v in deltas)
        before = receiver.totals["engine_bytes"]
        seconds = timed(lambda: receiver.apply(deltas), args.repeats)
        rows.append((label, size, seconds, (receiver.totals["engine_bytes"] - before) // (args.repeats + 1)))
    receiver.verify()

    memcpy = rows[0][1] / rows[0][2]
    print(f"host: {os.cpu_count()} CPUs ({isa()}); model {payload / 2**20:.0f} MiB bf16, {len(full)} tensors; "
          f"engine weights {'live (sparse deltas)' if receiver.sparse_deltas else 'repacked (whole-layer deltas)'}; "
          f"1 thread per process; median of {args.repeats}")
    print("| path | payload MB | into engine MB | ms | MB/s | x memcpy |")
    print("|---|---|---|---|---|---|")
    for label, size, seconds, into in rows:
        print(f"| {label} | {size / 1e6:.2f} | {into / 1e6:.2f} | {seconds * 1e3:.1f} | {size / 1e6 / seconds:,.0f} | "
              f"{size / seconds / memcpy:.2f} |")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
