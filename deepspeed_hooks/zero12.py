"""ZeRO stage 1/2 (``DeepSpeedZeroOptimizer``): cast each rank's own fp32 partition.

Where DeepSpeed 0.19 rounds: ``DeepSpeedZeroOptimizer.step`` copies each group's fp32
partition into the rank's bf16 partition (round to nearest), then calls the module-level
``all_gather_dp_groups`` to gather the bf16 partitions into every rank's model. We wrap that
function (in ``deepspeed.runtime.zero.stage_1_and_2`` only): for an optimizer with Fair Cast
attached, and only inside its ``step``, the bf16 partition is overwritten with the fair cast of
the fp32 partition right before the gather. So the gathered model is what Fair Cast served.

Global element indices come from each bf16 param's ``_hp_mapping`` fragment:
``lp_fragment_address.start`` is where the fragment starts in the flattened param (independent
of DP size, padding and round-robin order); ``hp_fragment_address.start`` is where it sits in
the rank's fp32 partition.

State, kept in the base optimizer's state of each group's flat fp32 partition (so
``save_checkpoint``/``load_checkpoint`` carry it per rank):

* ``"export_cast_step"`` — int, number of exports done (keys the random bits);
* ``"export_cast_residual"`` — error feedback only: fp32/bf16 tensor shaped like the partition.
"""
from __future__ import annotations

import functools
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero import stage_1_and_2
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from faircast_dist import FairCaster
from faircast_dist.config import RESIDUAL_DTYPES

STEP_KEY = "export_cast_step"
RESIDUAL_KEY = "export_cast_residual"


class ZeroExport:
    """Fair Cast on one ``DeepSpeedZeroOptimizer``: casts the rank's fp32 partitions."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer, caster: FairCaster):
        self.optimizer = optimizer
        self.caster = caster
        self.in_step = False

    def _state(self, i: int) -> dict:
        return self.optimizer.optimizer.state[self.optimizer.single_partition_of_fp32_groups[i]]

    @torch.no_grad()
    def export(self) -> None:
        """Overwrite every bf16 partition of this rank with the fair cast of its fp32 partition."""
        opt = self.optimizer
        for i, params in enumerate(opt.bit16_groups):
            partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
            lp_partition = opt.parallel_partitioned_bit16_groups[i][partition_id]
            hp_partition = opt.single_partition_of_fp32_groups[i]
            state = self._state(i)
            residual = None
            if self.caster.method == "error_feedback":
                residual = state.get(RESIDUAL_KEY)
                if residual is None:
                    residual = state[RESIDUAL_KEY] = self.caster.new_residual(hp_partition)
            for lp in params:
                mapping = lp._hp_mapping
                if mapping is None:  # param not in this rank's partition
                    continue
                start, numel = mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel
                self.caster.cast(opt.param_names[lp], hp_partition.narrow(0, start, numel),
                                 index=mapping.lp_fragment_address.start,
                                 out=lp_partition.narrow(0, start, numel),
                                 residual=None if residual is None else residual.narrow(0, start, numel))
        self.caster.advance()
        for i in range(len(opt.bit16_groups)):
            self._state(i)[STEP_KEY] = self.caster.step

    @torch.no_grad()
    def gather(self, key: str | None = None) -> dict[str, torch.Tensor]:
        """Full fp32 tensors of every param, assembled from all ranks' partitions (collective).

        Args:
            key: an optimizer-state key of the flat partitions (e.g. ``"export_cast_residual"``),
                or None for the fp32 master weights themselves.

        Returns:
            ``{param name: float32 tensor of the param's full shape}`` on every rank.
        """
        opt, out = self.optimizer, {}
        for i, params in enumerate(opt.bit16_groups):
            hp_partition = opt.single_partition_of_fp32_groups[i]
            source = hp_partition if key is None else self._state(i).get(key)
            for lp in params:
                full = torch.zeros(lp.numel(), dtype=torch.float32, device=hp_partition.device)
                mapping = lp._hp_mapping
                if mapping is not None and source is not None:
                    hp, lp_at = mapping.hp_fragment_address, mapping.lp_fragment_address.start
                    full.narrow(0, lp_at, hp.numel).copy_(source.narrow(0, hp.start, hp.numel))
                dist.all_reduce(full, group=opt.real_dp_process_group[i])
                out[opt.param_names[lp]] = full.view(lp.shape)
        return out

    def after_load(self) -> None:
        """Re-read the cast state from the (just loaded) optimizer state.

        Raises:
            ValueError: if a saved residual does not match its partition (names the group).
        """
        opt = self.optimizer
        steps = {self._state(i).get(STEP_KEY) for i in range(len(opt.bit16_groups))}
        if len(steps) != 1:
            raise ValueError(f"export cast: param groups disagree on {STEP_KEY}: {sorted(map(str, steps))}")
        (step,) = steps
        self.caster.step = int(step or 0)
        dtype = RESIDUAL_DTYPES[self.caster.config.residual_dtype]
        for i in range(len(opt.bit16_groups)):
            state, hp = self._state(i), opt.single_partition_of_fp32_groups[i]
            residual = state.get(RESIDUAL_KEY)
            if residual is None:
                continue
            if residual.shape != hp.shape:
                raise ValueError(f"export cast: saved {RESIDUAL_KEY} of param group {i} has shape "
                                 f"{tuple(residual.shape)}, the partition has {tuple(hp.shape)}")
            # torch's Optimizer.load_state_dict casts float state to the param dtype: undo it.
            state[RESIDUAL_KEY] = residual.to(dtype)


def _gather_with_fair_cast(original, groups_flat, partitioned_param_groups, *args, **kwargs):
    export = _EXPORTS.get(id(partitioned_param_groups))
    if export is not None and export.in_step:
        export.export()
    return original(groups_flat, partitioned_param_groups, *args, **kwargs)


_EXPORTS: "weakref.WeakValueDictionary[int, ZeroExport]" = weakref.WeakValueDictionary()


def attach(optimizer, caster: FairCaster) -> ZeroExport:
    """Attach Fair Cast to a ``DeepSpeedZeroOptimizer`` (ZeRO stage 1 or 2).

    Raises:
        NotImplementedError: for any other optimizer wrapper (stage 0, BF16_Optimizer, stage 3).
    """
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        raise NotImplementedError(
            f'"export_cast" mode "fair" supports ZeRO stage 1 and 2 (DeepSpeedZeroOptimizer); '
            f"this engine uses {type(optimizer).__name__}")
    export = ZeroExport(optimizer, caster)
    _EXPORTS[id(optimizer.parallel_partitioned_bit16_groups)] = export
    if not getattr(stage_1_and_2.all_gather_dp_groups, "_faircast", False):
        wrapped = functools.partial(_gather_with_fair_cast, stage_1_and_2.all_gather_dp_groups)
        wrapped._faircast = True
        stage_1_and_2.all_gather_dp_groups = wrapped

    step, load_state_dict = optimizer.step, optimizer.load_state_dict

    @functools.wraps(step)
    def fair_step(*args, **kwargs):
        export.in_step = True
        try:
            return step(*args, **kwargs)
        finally:
            export.in_step = False

    @functools.wraps(load_state_dict)
    def fair_load_state_dict(*args, **kwargs):
        result = load_state_dict(*args, **kwargs)
        export.after_load()
        return result

    optimizer.step, optimizer.load_state_dict = fair_step, fair_load_state_dict
    optimizer.export_caster = caster
    return export
