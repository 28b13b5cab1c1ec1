"""The served bf16 weights: from a live engine (for an inference engine's ``load_weights``) or
from a checkpoint on disk (a CLI that writes safetensors).

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

from deepspeed_hooks.checkpoint import read_served


def served_weights(engine, bucket_bytes: int = 1 << 28) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, bf16 tensor of the param's full shape)`` for every param of the model.

    Under ZeRO-3 params are gathered a bucket at a time (at most ``bucket_bytes`` of bf16 plus
    one param more) and yielded as copies, so memory stays bounded; other stages yield the model's
    own (already full) bf16 params without copying — copy them if you keep them past a step.
    Collective under ZeRO-3: every rank must run the generator to the end.

    Args:
        engine: an initialized DeepSpeed engine.
        bucket_bytes: ZeRO-3 gather bucket size in bytes (default 256 MiB).
    """
    import deepspeed
    params = list(engine.module.named_parameters())
    if not any(hasattr(p, "ds_id") for _, p in params):
        yield from ((n, p.detach()) for n, p in params)
        return
    bucket, size = [], 0
    for i, (name, p) in enumerate(params):
        bucket.append((name, p))
        size += p.ds_numel * 2
        if size >= bucket_bytes or i == len(params) - 1:
            with deepspeed.zero.GatheredParameters([q for _, q in bucket]):
                copies = [(n, q.detach().clone()) for n, q in bucket]
            yield from copies
            bucket, size = [], 0


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
