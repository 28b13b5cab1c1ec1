"""What the tests share: raw bits, spawned process groups (a free port, one launcher), Fair Cast's warnings."""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import socket

import torch
import torch.multiprocessing as mp

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


def save_record(obj, path: str) -> None:
    """``torch.save`` to ``path`` complete or not at all (written aside, then renamed): what a rank reports
    for :func:`launch`'s ``reported``."""
    torch.save(obj, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def _rank(rank, worker, world, port, fault, args):
    # a native crash (SIGABRT, SIGSEGV, ...) leaves the Python stack here, at exit too: the file stays open
    faulthandler.enable(file=open(f"{fault}.{rank}", "w"), all_threads=True)  # noqa: SIM115
    worker(rank, world, port, *args)


GRACE_S = 10  # after a rank fails, how long the others may take to finish on their own (a record: < 1 s)


def launch(worker, world: int, *args, reported: list[str]) -> None:
    """Run ``worker(rank, world, port, *args)`` on ``world`` spawned processes (``port``: free on
    127.0.0.1, for ``MASTER_PORT``) and wait for them.

    - A launch whose rank lost the port to another process meanwhile (EADDRINUSE) is retried, up to
      3 launches.
    - A rank killed by SIGABRT once every path in ``reported`` exists (what the ranks write when all
      their work is done: write each with ``os.replace``, complete or absent) counts as finished:
      torch's gloo / DeepSpeed teardown rarely aborts at exit ("terminate called without an active
      exception", ../shared/notes/deepspeed.md; in CI once in test_fsdp, once in test_trl). The others get
      :data:`GRACE_S` seconds to finish (rank 0 may still be writing its record) before they are
      terminated.
    Raises:
        ValueError: ``reported`` is empty (every abort would then pass for finished).
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a rank failed; for a
            crash, the message ends with the Python stack of each rank that faulthandler caught.
    """
    if not reported:
        raise ValueError("launch needs the paths the ranks write when done (reported), at least one")
    fault = os.path.join(os.path.dirname(reported[0]), "fault")
    for attempt in range(3):
        try:
            context = mp.start_processes(_rank, args=(worker, world, free_port(), fault, args), nprocs=world,
                                         start_method="spawn", join=False)
            while not context.join(grace_period=GRACE_S):
                pass
            return
        except mp.ProcessRaisedException as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
        except mp.ProcessExitedException as err:
            if err.signal_name == "SIGABRT" and all(os.path.exists(p) for p in reported):
                return
            stacks = [f"rank {r}:\n{text}" for r in range(world)
                      if os.path.exists(f"{fault}.{r}") and (text := open(f"{fault}.{r}").read().strip())]
            if stacks:
                err.args = (f"{err}\n" + "\n".join(stacks),)
            raise


def aborted_after_reporting(log: str, reported: list[str]) -> bool:
    """Whether a launch (its output ``log``) failed only through the teardown abort at exit that
    :func:`launch` forgives: the log holds "terminate called without an active exception" and every
    path in ``reported`` (written with ``os.replace`` when a rank's work is done) exists."""
    return "terminate called without an active exception" in log and all(os.path.exists(p) for p in reported)


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


def checkpoint_parts(name: str, w: torch.Tensor, groups: int, heads: int) -> list[torch.Tensor] | None:
    """The checkpoint tensors a Megatron param fuses, by reshaping (the tests' own spelling, beside
    ``faircast_dist.fp8.FusedRows``): ``linear_qkv`` ``[G (q + 2) d, K]`` -> q, k, v (per query group: q heads, then
    k, then v); SwiGLU ``linear_fc1`` -> gate, up; else None. ``w`` any dtype (FP8: viewed as uint8)."""
    u = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    if name.endswith("linear_qkv.weight"):
        per = u.shape[0] // groups
        d = per // (heads // groups + 2)
        x = u.reshape(groups, per, u.shape[1])
        parts = [x[:, :per - 2 * d], x[:, per - 2 * d:per - d], x[:, per - d:]]
        parts = [p.reshape(-1, u.shape[1]) for p in parts]
    elif name.endswith("linear_fc1.weight"):
        parts = list(u.chunk(2))
    else:
        return None
    return [p.view(w.dtype) for p in parts] if u is not w else parts


def fuse_parts(name: str, parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of :func:`checkpoint_parts`."""
    us = [p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts]
    if name.endswith("linear_qkv.weight"):
        fused = torch.cat([u.reshape(groups, -1, u.shape[1]) for u in us], 1).reshape(-1, us[0].shape[1])
    else:
        fused = torch.cat(us)
    return fused.view(parts[0].dtype)


def block_stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` one after the other, each padded with zero rows to a multiple of 128 (the FP8 block stack)."""
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, -p.shape[0] % 128)) for p in parts])


def unstack(stack: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """The parts of :func:`block_stack` (``rows`` each) back out of ``stack`` (any dtype)."""
    out, at = [], 0
    for n in rows:
        out.append(stack[at:at + n] if stack.dtype != torch.float8_e4m3fn
                   else stack.view(torch.uint8)[at:at + n].view(torch.float8_e4m3fn))
        at += n + (-n % 128)
    return out


def reference_fp8_fused(config, snapshots, groups: int, heads: int) -> list[dict]:
    """:func:`reference_fp8` with 128x128 block scales on the checkpoint's tensors: each fused Megatron param
    (:func:`checkpoint_parts`) cast as the zero-padded stack of its parts (:func:`block_stack`), under its own
    name, and served fused back (its scales: the stack's)."""
    stacked = [{**snap, "masters": {n: block_stack(p) if (p := checkpoint_parts(n, m, groups, heads)) else m
                                    for n, m in snap["masters"].items()}} for snap in snapshots]
    out = []
    for snap, ref in zip(snapshots, reference_fp8(config, stacked)):
        for name, master in snap["masters"].items():
            parts = checkpoint_parts(name, master, groups, heads)
            if parts is not None and name in ref:
                ref[name] = fuse_parts(name, unstack(ref[name], [p.shape[0] for p in parts]), groups)
        out.append(ref)
    return out


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
    layout = config.scale_rule
    scales, residual, out = dict(scales or {}), {}, []
    for snap in snapshots:
        caster.step = snap["step"]
        served = {}
        for name, master in snap["masters"].items():
            if not fp8.fp8_param(config, name, tuple(master.shape)):
                continue
            x, shape = master.reshape(-1).float(), tuple(master.shape)
            r = residual.setdefault(name, torch.zeros_like(x))
            fmax = torch.finfo(torch.float32).max  # (error feedback: master + residual saturated, as the cast does)
            y = torch.where(torch.isfinite(x), torch.clamp(x + r, -fmax, fmax), x) if caster.method == "error_feedback" \
                else x.bfloat16().float() if config.fp8_round_bf16 else x
            index = layout.scale_index(shape, 0, x.numel())
            absmax = fp8.partial_absmax(y, index, index.max().item() + 1).view(layout.scale_shape(shape))
            scales[name], mult, _ = layout.next_scales(scales.get(name), absmax)
            s = fp8.element_scales(scales[name], index)
            m = None if mult is None else fp8.element_scales(mult, index)
            if caster.method in ("stochastic", "dithered"):
                q = rounding.cast_fp8_stochastic(x, s, caster.key(name), 0, multiplier=m)
            elif caster.method == "error_feedback":
                q = rounding.cast_fp8_error_feedback(x, s, r, multiplier=m)
            else:
                q = rounding.cast_fp8_nearest(x, s, via_bf16=config.fp8_round_bf16, multiplier=m)
            served[name] = q.view(shape)
            served[name[:-len("weight")] + layout.scale_name] = scales[name].clone()
        out.append(served)
    return out


def tiny_moe(intermediate: int = 40, hidden: int = 48, experts: int = 4):
    """A tiny real transformers 5 Qwen3-MoE model (one layer, seeded): its experts are fused 3-D params
    (``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``; I = 40 by default,
    so a 128-row block of gate rows would reach into the up rows)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64,
                                      moe_intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, num_experts=experts, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(cfg)


EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale|_scale_inv)?$")


def expert_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each transformers 5 fused experts tensor (and FP8 scales beside it, ``[E, ., .]``) given as
    its per-expert checkpoint tensors (``...experts.0.gate_proj.weight``, ``weight_scale``, ...), by reshaping: the
    tests' own spelling, beside ``faircast_dist.fp8.experts_rows``. Any dtype (FP8 viewed as uint8 to cut)."""
    out = {}
    for name, w in tensors.items():
        m = EXPERTS.match(name)
        if m is None:
            out[name] = w
            continue
        base, leaf, scale = m.groups()
        pieces = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else (leaf,)
        u = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
        for e in range(u.shape[0]):
            for piece, t in zip(pieces, u[e].chunk(len(pieces))):
                out[f"{base}.{e}.{piece}.weight{scale or ''}"] = t.view(w.dtype) if u is not w else t
    return out


def single_process_fp8(config, model, snapshots) -> list[dict]:
    """The FP8 served weights of ``model``'s params (transformers 5 fused experts included) exported in one process,
    one whole-param shard each, from each snapshot's masters (``{"step", "masters": {name: full fp32}}``, in
    order): ``{name: FP8 weight, scale name: scales}`` per snapshot."""
    from faircast_dist import FairCaster
    from faircast_dist.export import ExportState, Shard
    from faircast_dist.fp8 import fused_experts
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    state = ExportState(FairCaster(config), shapes=shapes, fused=fused_experts(model, shapes))
    out = []
    for snap in snapshots:  # (the state keeps each shard's FP8 bits and residual by its key, the param name)
        shards = [Shard(n, m.reshape(-1).float().clone(), torch.zeros(m.numel(), dtype=torch.bfloat16),
                        [(n, 0, m.numel(), 0)]) for n, m in snap["masters"].items() if n in state.fp8.shapes]
        state.caster.step = snap["step"]
        state.export_fp8(shards)
        out.append(dict(state.fp8.served([(n, None) for n in state.fp8.shapes], state.full_fp8(shards))))
    return out
