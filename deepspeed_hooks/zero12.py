"""ZeRO stage 1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: flat fp32 partitions.

Where DeepSpeed 0.19 rounds: both wrappers' ``step`` copy each group's fp32 partition into the
rank's bf16 partition (round to nearest) — ``bit16_partitions[rank].data.copy_(fp32_partition.data)``
inline in ``step`` (ZeRO-Offload: into a host staging buffer, ``param_buffer_of_bit16_for_cpu_offload_groups``,
then on to the device) and in ``BF16_Optimizer.update_lp_params`` — then call the module-level
``all_gather_dp_groups`` (also from ``update_lp_params`` after a universal-checkpoint load).

Fair Cast takes the place of that copy (DeepSpeed has no seam there: see :mod:`deepspeed_hooks.compat`),
so the step makes one pass over the partition, not two:
while the wrapped ``step`` runs, :class:`faircast_dist.copy_hook.ReplaceCopies` turns exactly
that ``copy_`` — destination the group's bf16 partition or staging buffer, source its fp32
partition, matched by storage address and size — into the group's fused Fair Cast into the same
destination (padding between fragments gets the stock round-to-nearest copy, so every bit of the
destination is what the stock copy then the overwrite gave before). Every other torch call passes
through unchanged. We also wrap ``all_gather_dp_groups`` in ``deepspeed.runtime.zero.stage_1_and_2``
and ``deepspeed.runtime.bf16_optimizer``: inside a step, any group whose copy was not seen (a
DeepSpeed version that copies differently) is cast into its bf16 partition right before the
gather, as the stock copy's overwrite; outside a step (a load), the served bf16 values saved in
the checkpoint are put back instead of the nearest rounding.

Global element indices come from each bf16 param's ``_hp_mapping`` fragment (:func:`deepspeed_hooks.compat.hp_fragment`):
``lp_fragment_address.start`` is where the fragment starts in the flattened param (independent of
DP size and padding); ``hp_fragment_address.start`` is where it sits in the rank's fp32
partition. DeepSpeed builds that mapping in the original param order, which is wrong under
``round_robin_gradients`` (the flat buffer is then reordered): that setting is refused.
"""
from __future__ import annotations

import functools
import weakref

import torch
from deepspeed import comm as dist

from deepspeed_hooks import compat
from deepspeed_hooks.export import Fragment, OptimizerExport
from faircast_dist.copy_hook import ReplaceCopies

#: the installed exports by ``id`` of their per-rank bf16 partition lists (what ``all_gather_dp_groups``
#: gets), for the shared gather wrapper; an export leaves at uninstall (or when it is collected)
_EXPORTS: "weakref.WeakValueDictionary[int, FlatPartitionExport]" = weakref.WeakValueDictionary()


class FlatPartitionExport(OptimizerExport):
    """Flat partitioned groups of a ``DeepSpeedZeroOptimizer`` or ``BF16_Optimizer``."""

    def __init__(self, optimizer, caster, param_names, model):
        super().__init__(optimizer, caster, param_names, model)
        self.lp_groups, self.lp_partitions, self.hp_partitions = compat.flat_partitions(optimizer)

    def dp_group(self, i):
        return compat.dp_groups(self.optimizer)[i]

    def groups(self):
        out = []
        for i, params in enumerate(self.lp_groups):
            lp = self.lp_partitions[i][dist.get_rank(group=self.dp_group(i))]
            fragments = []
            for p in params:
                piece = compat.hp_fragment(p)
                if piece is not None:  # None: the param lies in another rank's partition
                    start, numel, index = piece
                    fragments.append(Fragment(self.param_names[p], start, numel, index, lp.narrow(0, start, numel)))
            out.append((self.hp_partitions[i], fragments))
        return out

    def step_context(self):
        return ReplaceCopies(self.replace_copy)

    def replace_copy(self, dest: torch.Tensor, src: torch.Tensor) -> bool:
        """If ``dest.copy_(src)`` is a group's stock copy, do its Fair Cast instead (True)."""
        i = self.copy_target(dest, src)
        if i is not None:
            self.cast_copy(i, dest)
        return i is not None

    def copy_target(self, dest: torch.Tensor, src: torch.Tensor) -> int | None:
        """The group whose stock master->bf16 copy ``dest.copy_(src)`` is, or None."""
        if dest.dtype != torch.bfloat16 or src.dtype != torch.float32 or not dest.is_contiguous():
            return None
        staging = compat.offload_staging(self.optimizer)
        for i, hp in enumerate(self.hp_partitions):
            if src.data_ptr() != hp.data_ptr() or src.numel() != hp.numel() or dest.numel() != hp.numel():
                continue
            lp = self.lp_partitions[i][dist.get_rank(group=self.dp_group(i))]
            if dest.data_ptr() in (lp.data_ptr(), *(b.data_ptr() for b in staging[i:i + 1])):
                return i
        return None

    @torch.no_grad()
    def cast_copy(self, i: int, dest: torch.Tensor) -> None:
        """Group ``i``'s Fair Cast into ``dest`` (laid out like its fp32 partition) in place of the
        stock copy: fragments fused-cast, the padding between them copied (round to nearest)."""
        hp, fragments = self.groups()[i]
        dest, flat = dest.view(-1), hp.view(-1)
        self._cast(i, hp, fragments, out=dest)
        end = 0  # the padding: every gap before, between and after the fragments
        for start, numel in sorted((f.start, f.numel) for f in fragments) + [(flat.numel(), 0)]:
            if start > end:
                dest.narrow(0, end, start - end).copy_(flat.narrow(0, end, start - end))
            end = max(end, start + numel)

    def register(self) -> None:
        """Let the shared gather wrapper find this export (until :meth:`unregister`)."""
        _EXPORTS[id(self.lp_partitions)] = self

    def unregister(self) -> None:
        _EXPORTS.pop(id(self.lp_partitions), None)


def wrap_gather(original):
    """The shared wrapper of a module's ``all_gather_dp_groups`` (see the module docstring)."""
    @functools.wraps(original)
    def all_gather_dp_groups(groups_flat, partitioned_param_groups, *args, **kwargs):
        export = _EXPORTS.get(id(partitioned_param_groups))
        if export is not None:
            if export.in_step:
                export.export()  # the groups whose copy was not turned into their cast; then finish()
            else:
                export.restore_served()
        return original(groups_flat, partitioned_param_groups, *args, **kwargs)
    return all_gather_dp_groups


def attach(optimizer, caster, param_names, model) -> FlatPartitionExport:
    """Fair Cast's export for a ``DeepSpeedZeroOptimizer`` (ZeRO-1/2, offload too) or ``BF16_Optimizer``.

    Raises:
        NotImplementedError: with ``zero_optimization.round_robin_gradients``: DeepSpeed 0.19
            builds the ``_hp_mapping`` fragments in the original param order while the flat buffer
            is in round-robin order, so the fragments would name the wrong params.
    """
    if compat.round_robin_gradients(optimizer):
        raise NotImplementedError('"export_cast" mode "fair" does not support "zero_optimization": '
                                  '{"round_robin_gradients": true}: DeepSpeed\'s fragment mapping ignores the '
                                  "round-robin order of the flat buffer (it would key elements by the wrong param)")
    return FlatPartitionExport(optimizer, caster, param_names, model)
