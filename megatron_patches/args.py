"""The ``--export-cast`` arguments, as a Megatron-LM ``extra_args_provider``.

    --export-cast {nearest,fair}                     default nearest (stock round to nearest)
    --export-cast-method {stochastic,error_feedback,dithered} default stochastic (error-feedback: the same)
    --export-cast-seed INT                           default 1234
    --export-cast-residual-dtype {float32,bfloat16}  default float32 (error feedback's residual)
    --export-cast-format {bf16,fp8}                  default bf16 (fp8: FP8 E4M3 served weights too)
    --export-cast-fp8-scales {channel,block}         default channel (one scale per output row)
    --[no-]export-cast-fp8-ue8m0                     default off (power-of-two scales)
    --[no-]export-cast-fp8-via-bf16                  default off (round-to-nearest via bf16: the stacks')
    --export-cast-fp8-exclude REGEX                  default: embeddings, output layer, norms, routers
    --export-cast-fp8-rule {verl,vllm-fp8-per-channel,...}  default none (faircast's scales; a stack's quantizer)
    --[no-]export-cast-fp8-grid                      default off (the bf16 params hold the served FP8 values)
    --[no-]export-cast-telemetry                     default on (with --tensorboard-dir / --wandb-project)

Under ``faircast-run`` the defaults of all but the last are ``FAIRCAST_EXPORT_CAST``'s: a flag given on
the command line wins, the variable fills what the command line leaves unset, and the parsed
``args`` (what Megatron-LM prints) are the config that runs.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from faircast_dist import ExportCastConfig
from faircast_dist.config import FORMATS, FP8_SCALES, METHODS, MODES, RESIDUAL_DTYPES, ConfigError, Method, env_config
from faircast_dist.fp8 import PRESETS

GROUP_TITLE = "export cast (Fair Cast)"
FLAGS = {"mode": "--export-cast", "method": "--export-cast-method", "seed": "--export-cast-seed",
         "residual_dtype": "--export-cast-residual-dtype", "format": "--export-cast-format",
         "fp8_scales": "--export-cast-fp8-scales", "fp8_ue8m0": "--export-cast-fp8-ue8m0",
         "fp8_via_bf16": "--export-cast-fp8-via-bf16", "fp8_exclude": "--export-cast-fp8-exclude",
         "fp8_rule": "--export-cast-fp8-rule", "fp8_grid": "--export-cast-fp8-grid"}  # field -> flag


def add_export_cast_args(parser: argparse.ArgumentParser,
                         defaults: Optional[ExportCastConfig] = None) -> argparse.ArgumentParser:
    """Add the ``--export-cast*`` group to ``parser``; an ``extra_args_provider`` itself.

    Idempotent: a parser that already has ``--export-cast`` is returned unchanged.

    Args:
        parser: Megatron-LM's argument parser.
        defaults: what the flags default to; None: ``FAIRCAST_EXPORT_CAST``'s config where it is set
            (under ``faircast-run``: so the command line wins over the variable), else
            :class:`ExportCastConfig`'s defaults (stock round to nearest).

    Returns:
        ``parser`` (Megatron-LM's providers return the parser).
    """
    if "--export-cast" in parser._option_string_actions:
        return parser
    defaults = defaults or env_config() or ExportCastConfig()
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument("--export-cast", choices=list(MODES), default=defaults.mode,
                       help="How the fp32 master weights are cast to the bf16 model weights: "
                            "'nearest' (stock round to nearest) or 'fair' (Fair Cast).")
    group.add_argument("--export-cast-method", choices=list(METHODS), type=_method, default=defaults.method.value,
                       help="With --export-cast fair: stochastic rounding (stateless), error "
                            "feedback (a residual per element, kept in the optimizer checkpoint) or "
                            "dithered rounding (stochastic rounding with a per-element dither fixed "
                            "across exports: stateless, few served weights change per step).")
    group.add_argument("--export-cast-seed", type=int, default=defaults.seed,
                       help="Seed of the stochastic / dithered rounding random bits (int64).")
    group.add_argument("--export-cast-residual-dtype", choices=list(RESIDUAL_DTYPES),
                       default=defaults.residual_dtype,
                       help="With --export-cast-method error-feedback: the residual's dtype (bfloat16 "
                            "halves its memory and rounds the residual itself).")
    group.add_argument("--export-cast-format", choices=list(FORMATS), default=defaults.format.value,
                       help="The served weights: 'bf16' (the model's bf16 params) or 'fp8': the 2-D linear weights "
                            "are also served as FP8 E4M3 with fp32 scales, cast from the fp32 masters by the "
                            "method (--export-cast nearest: round-to-nearest, what RL stacks do), for an FP8 "
                            "rollout engine (megatron_patches.served_weights).")
    group.add_argument("--export-cast-fp8-scales", choices=list(FP8_SCALES), default=defaults.fp8_scales,
                       help="With --export-cast-format fp8: 'channel', one fp32 scale per output row (weight_scale "
                            "[N, 1], vLLM's compressed-tensors FP8_DYNAMIC); 'block', one per 128x128 block "
                            "(weight_scale_inv, DeepSeek-V3 / Qwen3-FP8), the blocks of the checkpoint's q/k/v and "
                            "gate/up tensors that linear_qkv and linear_fc1 fuse.")
    group.add_argument("--export-cast-fp8-ue8m0", action=argparse.BooleanOptionalAction, default=defaults.fp8_ue8m0,
                       help="With --export-cast-format fp8: power-of-two scales.")
    group.add_argument("--export-cast-fp8-via-bf16", action=argparse.BooleanOptionalAction,
                       default=defaults.fp8_via_bf16,
                       help="With --export-cast-format fp8 and --export-cast nearest: round the master to bf16 "
                            "first (the RL stacks' double rounding, for comparison).")
    group.add_argument("--export-cast-fp8-exclude", default=defaults.fp8_exclude, metavar="REGEX",
                       help="With --export-cast-format fp8: params whose name matches stay bf16 (default: "
                            "embeddings, the output layer, norms, routers).")
    group.add_argument("--export-cast-fp8-rule", choices=list(PRESETS), default=defaults.fp8_rule,
                       help="With --export-cast-format fp8: scales and codes as an RL stack's FP8 quantizer computes "
                            "them (faircast_dist.fp8.PRESETS), instead of faircast's sticky scales: with "
                            "--export-cast nearest the stack's own bytes, with a fair method the stack's scales "
                            "and fair rounding. Sets the scales: leave --export-cast-fp8-scales/-ue8m0/-via-bf16 "
                            "unset.")
    group.add_argument("--export-cast-fp8-grid", action=argparse.BooleanOptionalAction, default=defaults.fp8_grid,
                       help="With --export-cast-fp8-rule (recomputed scales): every export writes the served FP8 "
                            "values bf16(q * s) into the bf16 params of the FP8 weights, so the stack's own "
                            "quantizer gets faircast's codes back; the trainer then computes with them.")
    group.add_argument("--export-cast-telemetry", action=argparse.BooleanOptionalAction, default=True,
                       help="With --export-cast fair and --tensorboard-dir or --wandb-project: log "
                            "export-cast/{changed-fraction,lag-steps,gap-ulps,export-ms} at every "
                            "--log-interval (measured on a fixed sample on the device).")
    return parser


def with_export_cast_args(provider: Optional[Callable] = None) -> Callable:
    """Chain ``provider`` (a script's own ``extra_args_provider``, or None) with ours.

    Example::

        pretrain(..., extra_args_provider=with_export_cast_args(add_my_args))

    Returns:
        a provider that applies ``provider`` and then :func:`add_export_cast_args`.
    """
    def chained(parser):
        if provider is not None:
            parser = provider(parser)
        return add_export_cast_args(parser)
    return chained


def config_from_args(args) -> ExportCastConfig:
    """The :class:`ExportCastConfig` of a parsed Megatron-LM namespace (absent flags = defaults).

    With ``--export-cast fair`` the precision flags are checked too.

    Raises:
        ValueError: a bad value (naming the flag), or ``fair`` with ``--fp16``, without
            ``--bf16``, or with ``--use-precision-aware-optimizer``.
    """
    try:
        config = ExportCastConfig(**_values(args))
    except ConfigError as err:
        raise ValueError(f"{FLAGS.get(err.field, '--export-cast')}: {err}") from None
    if config.enabled:
        from megatron_patches.optimizer import check_config
        check_config(args, where="the arguments")
    return config


def _method(value: str) -> str:
    """The method flag's value as the config spells it (``error-feedback`` is taken too); a plain ``str`` in the
    namespace (Megatron-LM saves its arguments in checkpoints)."""
    try:
        return Method(value).value
    except ValueError:
        return value  # argparse names it against the choices


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _values(args) -> dict:
    """``{ExportCastConfig field: value}`` of the flags in ``args`` (absent flags: the defaults)."""
    default = ExportCastConfig()
    values = {field: getattr(args, _dest(flag), getattr(default, field)) for field, flag in FLAGS.items()}
    return {**values, "method": _method(values["method"])}  # (a namespace built by hand may spell it either way)


def disagreements(args, defaults: ExportCastConfig) -> list[str]:
    """Where the parsed ``args`` differ from ``defaults`` (what the flags defaulted to, so a
    difference is a flag given on the command line): ``"--flag VALUE (command line) over FIELD
    VALUE"`` items, in flag order; ``[]`` when they agree."""
    values = _values(args)
    return [f"{flag} {values[field]!s} (command line) over {field} {getattr(defaults, field)!s}"
            for field, flag in FLAGS.items() if values[field] != getattr(defaults, field)]
