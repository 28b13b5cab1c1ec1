"""ZeRO stage 0: ``FP16_UnfusedOptimizer`` (torch optimizers) and ``FP16_Optimizer`` (fused).

Every rank holds the full fp32 master and the full bf16 model, and DeepSpeed copies each fp32
param (unfused) or each param's slice of a flat fp32 group (fused) into the bf16 param at the
end of ``step`` (round to nearest; no communication follows). Fair Cast re-casts the same fp32
values right after ``step`` returns (unless the step was skipped), keyed by whole-param global
indices — so every replica computes the same bits with no communication (docs/design.md invariant 2).
"""
from __future__ import annotations

from deepspeed_hooks import compat
from deepspeed_hooks.export import Fragment, OptimizerExport


class Stage0Export(OptimizerExport):
    """Full params on every rank: one group per param (``FP16_UnfusedOptimizer``: ``fp32_groups[g][j]``
    served into ``fp16_groups[g][j]``) or per param group (``FP16_Optimizer``: the flat
    ``fp32_groups_flat[g]`` holds its params back to back)."""

    replicated = True
    step_exports = True  # the stock copy runs at the end of step: re-cast after it returns

    def groups(self):
        flat, per_param, lp_groups = compat.stage0_groups(self.optimizer)
        if flat is None:
            return [(hp, [Fragment(self.param_names[lp], 0, lp.numel(), 0, lp.data.view(-1))])
                    for hp_group, lp_group in zip(per_param, lp_groups) for hp, lp in zip(hp_group, lp_group)]
        out = []
        for hp, lp_group in zip(flat, lp_groups):
            fragments, start = [], 0
            for lp in lp_group:
                fragments.append(Fragment(self.param_names[lp], start, lp.numel(), 0, lp.data.view(-1)))
                start += lp.numel()
            out.append((hp, fragments))
        return out


def attach(optimizer, caster, param_names, model) -> Stage0Export:
    """Fair Cast's export for a stage-0 ``FP16_UnfusedOptimizer`` or ``FP16_Optimizer``."""
    return Stage0Export(optimizer, caster, param_names, model)
