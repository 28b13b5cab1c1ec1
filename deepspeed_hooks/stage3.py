"""ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``): per-param partitions in flat sub-groups.

Where DeepSpeed 0.19 rounds: after stepping a sub-group, ``step`` calls
``_reassign_or_swap_out_partitioned_parameters(sub_group_id)``, which copies the fp32 sub-group
into the bf16 sub-group (round to nearest) and re-points each param's ``ds_tensor`` at it. Fair
Cast replaces that copy for the in-memory path: it casts into the same flat bf16 buffer, then
lets DeepSpeed re-point the params as before. On load DeepSpeed re-rounds bf16 from fp32 to
nearest; the served values saved with the checkpoint are written back after it.

Layout (:func:`deepspeed_hooks.compat.zero3_partition`): with DP ranks, param ``p`` is cut into
``pn = ceil(p.ds_numel / DP)`` elements per rank;
rank r holds elements ``[r*pn, (r+1)*pn)`` of the flattened param (indices >= ds_numel are
padding, never cast). A sub-group's flat fp32 buffer is its params' partitions back to back.
"""
from __future__ import annotations

import functools

from deepspeed import comm as dist

from deepspeed_hooks import compat
from deepspeed_hooks.export import Fragment, OptimizerExport


class Stage3Export(OptimizerExport):
    def dp_group(self, i):
        return self.optimizer.dp_process_group

    def groups(self):
        return [self.group(i) for i in range(len(compat.zero3_groups(self.optimizer)[0]))]

    def group(self, i):
        """Sub-group ``i`` alone (``step`` casts one sub-group at a time)."""
        lp_groups, lp_flats, hp_flats = compat.zero3_groups(self.optimizer)
        rank = dist.get_rank(group=self.dp_group(i))
        fragments, start = [], 0
        for p in lp_groups[i]:
            index, numel, part = compat.zero3_partition(p, rank)
            if numel:
                fragments.append(Fragment(self.param_names[p], start, numel, index, lp_flats[i].narrow(0, start, numel)))
            start += part
        return hp_flats[i], fragments

    def wrap_reassign(self, reassign):
        """:data:`~deepspeed_hooks.compat.ZERO3_REASSIGN`: in a step, cast the sub-group into its
        flat bf16 buffer instead of the stock copy, then re-point the params as DeepSpeed does."""
        @functools.wraps(reassign)
        def fair_reassign(sub_group_id):
            if not self.in_step:
                return reassign(sub_group_id)
            self.export_group(sub_group_id)
            compat.zero3_repoint(self.optimizer, sub_group_id)
        return fair_reassign

    def wrap_load_restores_served(self, load_state_dict):
        """``load_state_dict`` (outside the common wrap): ZeRO-3 re-rounds bf16 from fp32 to
        nearest on load, so put back what was served."""
        @functools.wraps(load_state_dict)
        def load_and_restore(*args, **kwargs):
            result = load_state_dict(*args, **kwargs)  # after_load has run
            self.restore_served()
            return result
        return load_and_restore


def attach(optimizer, caster, param_names, model) -> Stage3Export:
    """Fair Cast's export for a ``DeepSpeedZeroOptimizer_Stage3``.

    Raises:
        NotImplementedError: with NVMe parameter swapping (no in-memory bf16 buffer to cast into).
    """
    if any(flat is None for flat in compat.zero3_groups(optimizer)[1]):
        raise NotImplementedError('"export_cast" mode "fair" does not support ZeRO-3 NVMe parameter swapping yet')
    return Stage3Export(optimizer, caster, param_names, model)
