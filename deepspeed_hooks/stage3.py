"""ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``): per-param partitions in flat sub-groups.

Where DeepSpeed 0.19 rounds: after stepping a sub-group, ``step`` calls
``_reassign_or_swap_out_partitioned_parameters(sub_group_id)``, which copies the fp32 sub-group
into the bf16 sub-group (round to nearest) and re-points each param's ``ds_tensor`` at it. Fair
Cast replaces that copy for the in-memory path: it casts into the same flat bf16 buffer, then
lets DeepSpeed re-point the params as before. On load DeepSpeed re-rounds bf16 from fp32 to
nearest; the served values saved with the checkpoint are written back after it.

Layout: with DP ranks, param ``p`` is cut into ``pn = ceil(p.ds_numel / DP)`` elements per rank;
rank r holds elements ``[r*pn, (r+1)*pn)`` of the flattened param (indices >= ds_numel are
padding, never cast). A sub-group's flat fp32 buffer is its params' partitions back to back.
"""
from __future__ import annotations

import functools

from deepspeed import comm as dist

from deepspeed_hooks.export import Fragment, OptimizerExport, wrap_methods


class Stage3Export(OptimizerExport):
    def dp_group(self, i):
        return self.optimizer.dp_process_group

    def groups(self):
        return [self.group(i) for i in range(len(self.optimizer.fp16_groups))]

    def group(self, i):
        """Sub-group ``i`` alone (``step`` casts one sub-group at a time)."""
        opt = self.optimizer
        rank = dist.get_rank(group=opt.dp_process_group)
        lp_flat, fragments, start = opt.fp16_partitioned_groups_flat[i], [], 0
        for p in opt.fp16_groups[i]:
            pn = p.ds_tensor.ds_numel
            numel = max(0, min(pn, p.ds_numel - rank * pn))
            if numel:
                fragments.append(Fragment(self.param_names[p], start, numel, rank * pn,
                                          lp_flat.narrow(0, start, numel)))
            start += pn
        return opt.fp32_partitioned_groups_flat[i], fragments


def attach(optimizer, caster, param_names) -> Stage3Export:
    """Attach Fair Cast to a ``DeepSpeedZeroOptimizer_Stage3``.

    Raises:
        NotImplementedError: with NVMe parameter swapping (no in-memory bf16 buffer to cast into).
    """
    if any(flat is None for flat in optimizer.fp16_partitioned_groups_flat):
        raise NotImplementedError('"export_cast" mode "fair" does not support ZeRO-3 NVMe parameter swapping yet')
    export = Stage3Export(optimizer, caster, param_names)
    reassign = optimizer._reassign_or_swap_out_partitioned_parameters

    @functools.wraps(reassign)
    def fair_reassign(sub_group_id):
        if not export.in_step:
            return reassign(sub_group_id)
        export.export_group(sub_group_id)
        optimizer._unflatten_partitioned_parameters(sub_group_id)

    optimizer._reassign_or_swap_out_partitioned_parameters = fair_reassign
    wrap_methods(optimizer, export, step_exports=False)
    load_state_dict = optimizer.load_state_dict

    @functools.wraps(load_state_dict)
    def load_and_restore(*args, **kwargs):
        result = load_state_dict(*args, **kwargs)  # after_load has run
        export.restore_served()  # ZeRO-3 re-rounded bf16 from fp32 to nearest: put back what was served
        return result

    optimizer.load_state_dict = load_and_restore
    return export
