"""ZeRO stage 0: ``FP16_UnfusedOptimizer`` (torch optimizers) and ``FP16_Optimizer`` (fused).

Every rank holds the full fp32 master and the full bf16 model, and DeepSpeed copies each fp32
param (unfused) or each param's slice of a flat fp32 group (fused) into the bf16 param at the
end of ``step`` (round to nearest; no communication follows). Fair Cast re-casts the same fp32
values right after ``step`` returns (unless the step was skipped), keyed by whole-param global
indices — so every replica computes the same bits with no communication (docs/design.md invariant 2).
"""
from __future__ import annotations

from deepspeed_hooks.export import Fragment, OptimizerExport, wrap_methods


class UnfusedExport(OptimizerExport):
    """One group per param: ``fp32_groups[g][j]`` served into ``fp16_groups[g][j]``."""

    replicated = True

    def groups(self):
        opt = self.optimizer
        return [(hp, [Fragment(self.param_names[lp], 0, lp.numel(), 0, lp.data.view(-1))])
                for hp_group, lp_group in zip(opt.fp32_groups, opt.fp16_groups)
                for hp, lp in zip(hp_group, lp_group)]


class FusedExport(OptimizerExport):
    """One group per param group: the flat ``fp32_groups_flat[g]`` holds its params back to back."""

    replicated = True

    def groups(self):
        opt, out = self.optimizer, []
        for hp, lp_group in zip(opt.fp32_groups_flat, opt.fp16_groups):
            fragments, start = [], 0
            for lp in lp_group:
                fragments.append(Fragment(self.param_names[lp], start, lp.numel(), 0, lp.data.view(-1)))
                start += lp.numel()
            out.append((hp, fragments))
        return out


def attach(optimizer, caster, param_names) -> OptimizerExport:
    """Attach Fair Cast to a stage-0 ``FP16_UnfusedOptimizer`` or ``FP16_Optimizer``."""
    cls = FusedExport if hasattr(optimizer, "fp32_groups_flat") else UnfusedExport
    export = cls(optimizer, caster, param_names)
    wrap_methods(optimizer, export, step_exports=True)
    return export
