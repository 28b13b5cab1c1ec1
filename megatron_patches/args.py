"""The ``--export-cast`` arguments, as a Megatron-LM ``extra_args_provider``.

    --export-cast {nearest,fair}                     default nearest (stock round to nearest)
    --export-cast-method {stochastic,error-feedback,dithered} default stochastic
    --export-cast-seed INT                           default 1234
    --[no-]export-cast-telemetry                     default on (with --tensorboard-dir / --wandb-project)
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from faircast_dist import ExportCastConfig
from faircast_dist.config import ConfigError

GROUP_TITLE = "export cast (Fair Cast)"


def add_export_cast_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--export-cast*`` group to ``parser``; an ``extra_args_provider`` itself.

    Idempotent: a parser that already has ``--export-cast`` is returned unchanged.

    Returns:
        ``parser`` (Megatron-LM's providers return the parser).
    """
    if "--export-cast" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument("--export-cast", choices=["nearest", "fair"], default="nearest",
                       help="How the fp32 master weights are cast to the bf16 model weights: "
                            "'nearest' (stock round to nearest) or 'fair' (Fair Cast).")
    group.add_argument("--export-cast-method", choices=["stochastic", "error-feedback", "dithered"],
                       default="stochastic",
                       help="With --export-cast fair: stochastic rounding (stateless), error "
                            "feedback (a residual per element, kept in the optimizer checkpoint) or "
                            "dithered rounding (stochastic rounding with a per-element dither fixed "
                            "across exports: stateless, few served weights change per step).")
    group.add_argument("--export-cast-seed", type=int, default=1234,
                       help="Seed of the stochastic / dithered rounding random bits (int64).")
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
    mode = getattr(args, "export_cast", "nearest")
    method = getattr(args, "export_cast_method", "stochastic")
    seed = getattr(args, "export_cast_seed", 1234)
    try:
        config = ExportCastConfig(mode=mode, method=method, seed=seed)
    except ConfigError as err:
        flag = {"mode": "--export-cast", "method": "--export-cast-method", "seed": "--export-cast-seed"}
        raise ValueError(f"{flag.get(err.field, '--export-cast')}: {err}") from None
    if config.enabled:
        from megatron_patches.optimizer import check_config
        check_config(args, where="the arguments")
    return config
