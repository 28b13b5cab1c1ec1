"""The export cast of an FSDP2 model: each rank's fp32 shards cast to the bf16 shards FSDP
all-gathers for compute, and served.

One :class:`FsdpExport` per model. It keeps, per param, a flat bf16 buffer shaped like FSDP's
padded fp32 shard (2 bytes per local element); its :class:`~faircast_dist.export.ExportState` keeps
the step and, for error feedback, the residual of each param's shard. The cast runs
once per optimizer step, lazily: the first all-gather after the masters changed casts every
shard in one fused call (:meth:`faircast_dist.export.ExportState.export`); every re-gather of that
step (backward with ``reshard_after_forward``, gradient accumulation) and :func:`served_weights`
use the same bits. The masters changed when the optimizer stepped (an
``optimizer.register_step_post_hook``, which also counts the export step) or when the params' version
counters moved (``load_state_dict``, an in-place edit of the params).
"""
from __future__ import annotations

import torch

from faircast_dist import FairCaster
from faircast_dist.export import ExportState, Shard
from faircast_dist.fp8 import fused_experts
from faircast_dist.shards import block_index, index_runs
from fsdp_hooks import compat


WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile


def canonical_name(name: str) -> str:
    """A param's name without the segments that activation-checkpointing and ``torch.compile``
    wrappers insert (as ``torch.distributed.checkpoint``'s state dicts and torchtitan's
    ``canonical_fqn`` drop them), so a param keys the same bits with and without them."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


class FsdpExport:
    """Fair Cast state of one ``fully_shard``-ed model (built by :func:`fsdp_hooks.install`).

    Args:
        model: the root module (names come from its ``named_parameters()``).
        caster: the :class:`~faircast_dist.FairCaster` (config, export step).

    Attributes:
        state: the :class:`~faircast_dist.export.ExportState` (step, residuals keyed by param name,
            telemetry).
        names: canonical param names (:func:`canonical_name` of ``model.named_parameters()``), in
            that order; :attr:`params` (FSDP's ``FSDPParam`` objects) and the buffers follow it.
        outs: per param, bfloat16 1-D buffer of FSDP's padded shard size: the cast local shard
            (padding zero).
        counted: per param, whether the drift telemetry counts its local block on this rank (no lower
            rank holds the same block: HSDP replicas, params TP replicates or leaves out of its mesh
            count once).

    Raises:
        TypeError: a param whose sharded master is not float32 (named).
    """

    def __init__(self, model: torch.nn.Module, caster: FairCaster):
        order = {id(p): (i, canonical_name(n)) for i, (n, p) in enumerate(model.named_parameters())}
        self.params = sorted(compat.fsdp_params(model), key=lambda fp: order[id(fp.sharded_param)][0])
        self.names = [order[id(fp.sharded_param)][1] for fp in self.params]
        shapes = {n: tuple(fp.sharded_param.shape) for n, fp in zip(self.names, self.params)}
        fused = fused_experts(model, shapes, canonical_name) if caster.config.fp8 else None
        self.state = ExportState(caster, replays=False,  # outs are Fair Cast's own: nothing overwrites them
                                 shapes=shapes, fused=fused,  # FP8: every rank holds every param's DTensor
                                 device=self.params[0].sharded_param.device if self.params else None)
        for name, fp in zip(self.names, self.params):
            if compat.padded_shard(fp).dtype != torch.float32:
                raise TypeError(f"fsdp_hooks: param {name!r} is {compat.padded_shard(fp).dtype}: Fair Cast casts "
                                "float32 master params (fully_shard an fp32 model, MixedPrecisionPolicy(param_dtype=bf16))")
        self.runs = []  # per param: (name, start in the shard, numel, global index) of each run
        for name, fp in zip(self.names, self.params):
            local_shape, offsets = compat.global_offset(fp.sharded_param)
            index = block_index(fp.sharded_param.shape, offsets, local_shape)
            self.runs.append([(name, *map(int, row)) for row in index_runs(index)])
        # what stock FSDP2 served before the first export (its round-to-nearest all-gather input; the
        # padding is zero): the telemetry's first export counts its changes from it
        self.outs = [compat.padded_shard(fp).to(torch.bfloat16) for fp in self.params]
        self.counted = [True] * len(self.params)  # fsdp_hooks.install(telemetry=True) sets it
        for shard in self.shards():  # residuals from the start: a checkpoint before the first export holds them
            self.state.residual(shard.key, shard.master)
        if self.state.fp8 is not None:  # the FP8 buffers too
            self.state.fp8_shards(self.shards())
        self._versions = None  # the params' version counters at the last export (None: never exported)
        self._hold = False  # outs were loaded: they are the export until the next optimizer step
        self._stepped = 0  # optimizer steps since the last export (the next one draws the step they bring it to)

    @property
    def caster(self) -> FairCaster:
        return self.state.caster

    @property
    def residuals(self) -> list[torch.Tensor] | None:
        """Error feedback: per param, the residual (1-D, padded shard size, the configured residual
        dtype; :attr:`state`'s, in :attr:`names` order), else None."""
        return [self.state.residuals[n] for n in self.names] if self.state.method.needs_residual else None

    def shards(self) -> list[Shard]:
        """Per param, its padded fp32 shard and :attr:`outs` buffer (FSDP may replace the shard's
        storage, e.g. on a load: read anew at each export)."""
        return [Shard(name, compat.padded_shard(fp), out, runs, counted)
                for name, fp, out, runs, counted in zip(self.names, self.params, self.outs, self.runs, self.counted)]

    def stale(self) -> bool:
        """The masters changed since the last export (or there was none)."""
        return self._versions != self.versions()

    def versions(self) -> list[tuple[int, int, int]]:
        """Per param: the DTensor param's identity and version counter (bumped by in-place updates:
        the DTensor's, not its local tensor's, whose ops run below autograd) and its shard's identity."""
        return [(id(fp.sharded_param), fp.sharded_param._version, id(compat.padded_shard(fp))) for fp in self.params]

    def export(self) -> None:
        """Cast every local fp32 shard into :attr:`outs` (one fused call), and with ``format "fp8"`` into the FP8
        buffers (collective: one MAX all-reduce of the scales' absmax), at the export step of the optimizer steps
        taken (:meth:`stepped`): the cast is lazy, and an export without a step in between (the first, or after an
        in-place edit of the params) draws the step it stands at."""
        self.state.export(self.shards(), step=self.state.step + self._stepped)
        self._stepped = 0
        self._versions = self.versions()

    def ensure(self) -> None:
        """Export if the masters changed since the last export (not after a load: :meth:`loaded`)."""
        if self._hold:
            self._versions = self.versions()
        elif self.stale():
            self.export()

    def loaded(self) -> None:
        """Take :attr:`outs` (restored from a checkpoint) as the export of the masters until the next
        optimizer step, whenever the masters themselves are restored."""
        self._hold, self._stepped = True, 0

    def invalidate(self) -> None:
        """Export again at the next all-gather, at the loaded export step (after a load that restored no served
        shards)."""
        self._versions, self._hold, self._stepped = None, False, 0

    def stepped(self) -> None:
        """The optimizer stepped: the next all-gather casts the new masters at the next export step."""
        self._stepped += 1
        self._versions, self._hold = None, False  # whatever the version counters say: AdamW(fused=True)
        # and optimizers that write p.data (HF Trainer's default is fused AdamW) move none of them

    def pre_all_gather(self, k, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP's ``fsdp_pre_all_gather`` for param ``k`` (bound with ``functools.partial``): its
        bf16 all-gather input is its cast shard, in FSDP's padded shard shape."""
        self.ensure()
        fp = self.params[k]
        return (self.outs[k].view(fp.padded_sharded_param_size).to(fp.device, non_blocking=True),), None

    @staticmethod
    def post_all_gather(outputs, metadata, param_dtype, *, out=None):
        """FSDP's ``fsdp_post_all_gather``: the gathered bf16 tensor is the unsharded param."""
        (output,) = outputs
        if out is not None:  # a later gather: FSDP re-filled the storage of the tensor returned first
            return None
        return output, (output,)

    def dtensors(self, buffers: dict) -> dict:
        """``{name: DTensor}``: each param's local block of ``buffers`` (``{name: 1-D padded shard}``, e.g. a
        snapshot's), sharded like the param (its mesh, placements, shape); no communication."""
        from torch.distributed.tensor import DTensor
        out = {}
        for name, fp in zip(self.names, self.params):
            p, local = fp.sharded_param, fp.sharded_param._local_tensor
            out[name] = DTensor.from_local(buffers[name][:local.numel()].view(local.shape), p.device_mesh,
                                           p.placements, run_check=False, shape=p.shape, stride=p.stride())
        return out

    def locals(self, dtensors: dict | None) -> dict | None:
        """``{name: 1-D tensor of FSDP's padded shard size}``: each loaded DTensor's local block, zero-padded as the
        shard is (the inverse of :meth:`dtensors`); None for None."""
        if dtensors is None:
            return None
        out = {}
        for name, fp in zip(self.names, self.params):
            if dtensors and name in dtensors:
                local, padded = dtensors[name].to_local().reshape(-1), compat.padded_shard(fp).numel()
                out[name] = local if local.numel() == padded else torch.cat([local, local.new_zeros(padded - local.numel())])
        return out
