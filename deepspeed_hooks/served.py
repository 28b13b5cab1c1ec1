"""The served bf16 weights: from a live engine (for an inference engine's ``load_weights``), as
deltas since the previous sync (:func:`served_deltas`), or from a checkpoint on disk (a CLI that
writes safetensors).

    python -m deepspeed_hooks.served CHECKPOINT_DIR served.safetensors [--tag global_step100]

With Fair Cast the model's bf16 params *are* what Fair Cast served. Stages 0/1/2 save them in
``mp_rank_00_model_states.pt``; ZeRO-3 saves no bf16 weights, so the CLI rebuilds them from the
``export_cast_served`` partitions that Fair Cast adds to each rank's optimizer state (and frozen
params from DeepSpeed's ``frozen_param_fragments``).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch

from deepspeed_hooks import compat
from deepspeed_hooks.checkpoint import read_served
from faircast_dist.config import STATE_KEY
from faircast_dist.delta import DeltaTracker, index_dtype


def served_weights(engine, bucket_bytes: int = 1 << 28, grid: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, bf16 tensor of the param's full shape)`` for every param of the model.

    Under ZeRO-3 params are gathered a bucket at a time (at most ``bucket_bytes`` of bf16 plus
    one param more) and yielded as copies, so memory stays bounded; other stages yield the model's
    own (already full) bf16 params without copying — copy them if you keep them past a step.
    Collective under ZeRO-3: every rank must run the generator to the end.

    With ``format "fp8"`` each FP8 param is yielded instead as ``(name, float8_e4m3fn [N, K])`` followed by
    ``(scale name, float32 scales)`` (:meth:`faircast_dist.fp8.Fp8Export.served`): the FP8 params are gathered
    first, in one uint8 all-reduce over the DP group (1 byte per FP8 element of the model; collective).

    Args:
        engine: an initialized DeepSpeed engine.
        bucket_bytes: ZeRO-3 gather bucket size in bytes (default 256 MiB).
        grid: with ``format "fp8"`` and an ``fp8_rule`` of recomputed scales: each FP8 param as bf16, its served
            FP8 values ``bf16(q * s)``, for an engine that quantizes bf16 itself (vLLM's online quantization): its
            quantizer returns faircast's codes (:meth:`faircast_dist.fp8.Fp8Export.grid`; ValueError otherwise).
    """
    export = getattr(engine.optimizer, STATE_KEY, None)
    if export is not None and export.state.fp8 is not None:
        full = export.state.full_fp8(export.shards())
        yield from export.state.fp8.served(_served_bf16(engine, bucket_bytes), full, grid=grid)
        return
    yield from _served_bf16(engine, bucket_bytes)


def _served_bf16(engine, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    import deepspeed
    params = list(engine.module.named_parameters())
    if not any(compat.is_zero3(p) for _, p in params):
        yield from ((n, p.detach()) for n, p in params)
        return
    for bucket in _zero3_buckets(params, bucket_bytes):
        with deepspeed.zero.GatheredParameters([q for _, q in bucket]):
            copies = [(n, q.detach().clone()) for n, q in bucket]
        yield from copies


def _zero3_buckets(params, bucket_bytes: int):
    """Consecutive lists of ``(name, ZeRO-3 param)`` of at least ``bucket_bytes`` of bf16 each
    (the last one may be smaller; one param may take a bucket past the limit)."""
    bucket, size = [], 0
    for i, (name, p) in enumerate(params):
        bucket.append((name, p))
        size += compat.full_numel(p) * 2
        if size >= bucket_bytes or i == len(params) - 1:
            yield bucket
            bucket, size = [], 0


def served_deltas(engine, tracker: DeltaTracker,
                  bucket_bytes: int = 1 << 28) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield ``(name, index, values)`` for every param: the served bf16 elements whose bits
    changed since ``tracker`` last saw them (see :mod:`faircast_dist.delta`).

    ``index`` holds ascending flat indices into the full param (int32, int64 for params of 2**31
    elements or more), the same under any stage and DP size; ``values`` the new bf16 values. A
    param with no change yields empty tensors; the first call (an empty tracker) yields every
    element. Apply them on the receiving side with :func:`faircast_dist.delta.apply_deltas`.

    Memory, kept in ``tracker`` (the caller's; one per rank, reused every call): stages 0/1/2
    diff the full bf16 params each rank already holds, so each rank keeps a bf16 copy of the
    model (2 bytes per element) and no communication happens; ZeRO-3 diffs each rank's own
    partition (``2 * numel / DP`` bytes) and all-gathers the deltas over the param's DP group a
    bucket of params at a time (``bucket_bytes`` of bf16 params per bucket, plus one param).
    Every rank yields the same deltas. Collective under ZeRO-3: every rank must run the generator
    to the end.

    With ``format "fp8"``, the deltas of :func:`served_weights`' tensors (FP8 weights, their scales, the bf16
    params), each rank diffing the full tensors.

    Args:
        engine: an initialized DeepSpeed engine (with or without Fair Cast).
        tracker: a :class:`faircast_dist.delta.DeltaTracker` used only with this engine.
        bucket_bytes: ZeRO-3 bucket size in bytes (default 256 MiB).
    """
    params = list(engine.module.named_parameters())
    export = getattr(engine.optimizer, STATE_KEY, None)
    if export is not None and export.state.fp8 is not None:
        yield from tracker.deltas(served_weights(engine, bucket_bytes))
        return
    if not any(compat.is_zero3(p) for _, p in params):
        yield from tracker.deltas((name, p.detach()) for name, p in params)
        return
    for bucket in _zero3_buckets(params, bucket_bytes):
        yield from _zero3_deltas(bucket, tracker)


@torch.no_grad()
def _zero3_deltas(bucket, tracker: DeltaTracker):
    """Each rank diffs its partitions (:func:`deepspeed_hooks.compat.zero3_local`), then one
    all-gather of counts and one of the packed (index, value bits) lists, as int64, padded to the
    longest rank's list."""
    from deepspeed import comm as dist
    local = []
    for name, p in bucket:
        part, start, group = compat.zero3_local(p)
        local.append(tracker.diff(name, part, start, compat.full_numel(p)))
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()  # the communication device (NCCL: CUDA; also with param offload)
    counts = torch.tensor([len(index) for index, _ in local], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    host_counts = torch.stack(all_counts).tolist()  # one device -> host read per bucket: sizes for the packing
    longest = max(sum(c) for c in host_counts)
    packed = torch.zeros(2 * longest, dtype=torch.int64, device=device)
    total = sum(host_counts[rank])
    if total:
        packed[:total] = torch.cat([index.to(torch.int64) for index, _ in local])
        packed[longest:longest + total] = torch.cat([values.view(torch.int16).to(torch.int64) for _, values in local])
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    offsets = [0] * world
    for j, (name, p) in enumerate(bucket):
        index, values = [], []
        for r in range(world):  # rank order: ascending indices
            c = host_counts[r][j]
            index.append(gathered[r][offsets[r]:offsets[r] + c])
            values.append(gathered[r][longest + offsets[r]:longest + offsets[r] + c])
            offsets[r] += c
        yield (name, torch.cat(index).to(index_dtype(compat.full_numel(p))),
               torch.cat(values).to(torch.int16).view(torch.bfloat16))


def read_checkpoint(folder: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The served bf16 weights saved in a DeepSpeed checkpoint: ``{name: bf16 tensor}``.

    Exactly the names and bits :func:`served_weights` yielded when the checkpoint was saved: every
    param, frozen ones included, tied weights once, no buffers (see
    :func:`deepspeed_hooks.checkpoint.read_served`).

    Args:
        folder: the ``save_dir`` given to ``engine.save_checkpoint``.
        tag: the checkpoint tag (default: the one named in ``folder/latest``).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a ZeRO-3 checkpoint written without Fair Cast (it stores no bf16 weights).
    """
    if tag is None:
        with open(os.path.join(folder, "latest")) as f:
            tag = f.read().strip()
    return read_served(os.path.join(folder, tag))


def main(argv=None) -> None:
    """CLI: write the served bf16 model of a checkpoint to a safetensors file."""
    from safetensors.torch import save_file
    p = argparse.ArgumentParser(description="Write the bf16 weights a Fair Cast DeepSpeed checkpoint served "
                                            "to a safetensors file.")
    p.add_argument("checkpoint", help="the folder given to engine.save_checkpoint")
    p.add_argument("output", help="the .safetensors file to write")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CHECKPOINT/latest)")
    args = p.parse_args(argv)
    weights = read_checkpoint(args.checkpoint, args.tag)
    tmp = args.output + ".tmp"
    save_file(weights, tmp, metadata={"format": "pt", "source": "faircast served bf16"})
    os.replace(tmp, args.output)  # never leave a half-written file under the final name
    print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values())} bf16 elements) to {args.output}")


if __name__ == "__main__":
    main()
