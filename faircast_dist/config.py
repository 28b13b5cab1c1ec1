"""The one export-cast configuration that both integrations parse into.

DeepSpeed:  ``"export_cast": {"mode": "fair", "method": "stochastic", "seed": 1234}``
            (shorthand ``"export_cast": "fair"``); FP8 served weights: ``"format": "fp8"``.
Megatron:   ``--export-cast fair --export-cast-method stochastic --export-cast-seed 1234``
            (``--export-cast-format fp8``).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from typing import Any

import torch


class Method(str, enum.Enum):
    """What the export cast does. A ``str`` (``Method.STOCHASTIC == "stochastic"``, f-strings give
    the value), so a method can be compared with, and written as, its config spelling; ``Method(v)``
    also takes the flag spelling with hyphens (``"error-feedback"``). It is what the kernels take
    (:attr:`kernel`, :data:`faircast_dist.fused.KERNEL_CODES`)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"
    ERROR_FEEDBACK = "error_feedback"
    DITHERED = "dithered"

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and "-" in value:
            return cls.__members__.get(value.replace("-", "_").upper())
        return None

    @property
    def needs_residual(self) -> bool:
        """Keeps a residual per element (error feedback)."""
        return self is Method.ERROR_FEEDBACK

    @property
    def keyed(self) -> bool:
        """Draws Philox random bits (stochastic and dithered rounding: the same kernel, other keys)."""
        return self in (Method.STOCHASTIC, Method.DITHERED)

    @property
    def kernel(self) -> "Method":
        """The kernel that runs it: dithered rounding is the stochastic-rounding kernel with the dither key."""
        return Method.STOCHASTIC if self.keyed else self


class Format(str, enum.Enum):
    """The served weights' format (a ``str``, like :class:`Method`): the model's bf16 params, or FP8 E4M3
    linear weights beside them."""

    BF16 = "bf16"
    FP8 = "fp8"

    __str__ = str.__str__
    __format__ = str.__format__


ENV = "FAIRCAST_EXPORT_CAST"  # the export_cast section from the environment (faircast-run)
STATE_KEY = "export_cast"  # the config section, and the checkpoint / state entry, in every adapter
MODES = ("nearest", "fair")
METHODS = tuple(m.value for m in Method if m is not Method.NEAREST)  # the methods of mode "fair"
RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = tuple(f.value for f in Format)
FP8_SCALES = ("channel", "block")
#: the params kept bf16 under ``format: "fp8"`` (a regex searched in the param name), as the RL stacks do: embeddings,
#: the LM head, norms, MoE routers (HF ``mlp.gate``, Megatron ``router``) and shared-expert gates (HF
#: ``shared_expert_gate``, Megatron ``shared_experts.gate_weight`` [1, H]). Biases and other 1-D/3-D params stay
#: bf16 anyway, except transformers 5's fused experts (:func:`faircast_dist.fp8.fused_experts`), which are FP8.
FP8_EXCLUDE = r"embed|lm_head|output_layer|norm|router|(^|\.)gate\.weight$|shared_expert_gate|(^|\.)gate_weight$"


class ConfigError(ValueError):
    """A bad export-cast setting. ``field``: the setting it names (``"mode"``, ``"method"``,
    ``"seed"``, ``"residual_dtype"``, ``"format"``, ``"fp8_..."``), or None (an unknown key, the section itself)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ExportCastConfig:
    """How the fp32 master weights are cast to the bf16 model weights.

    Args:
        mode: ``"nearest"`` (stock round-to-nearest; Fair Cast off) or ``"fair"``.
        method: with ``mode="fair"``, a :class:`Method` or its spelling (held as the
            :class:`Method`): ``"stochastic"`` (stochastic rounding, fresh random bits at every
            export, stateless), ``"error_feedback"`` (a residual per element;
            ``"error-feedback"`` is accepted) or ``"dithered"`` (stochastic rounding with a
            per-element dither fixed across exports: unbiased, stateless, a served weight
            changes only when its master crosses its own threshold; see
            :mod:`faircast_dist.rounding`).
        seed: seeds the Philox key of stochastic and dithered rounding (int, fits int64).
        residual_dtype: ``"float32"`` (default, exact) or ``"bfloat16"`` (half the memory,
            the residual itself is then rounded) for error feedback.
        format: the served weights: ``"bf16"`` (default: the model's bf16 params) or ``"fp8"``: the 2-D
            linear weights (and transformers 5's fused MoE experts) not matched by ``fp8_exclude`` are also
            served as FP8 E4M3 with fp32 scales, cast from the fp32 masters by the method (``mode
            "nearest"``: round-to-nearest, what RL stacks do), with their own state (sticky scales; error
            feedback: an fp32 residual). The model's bf16 params (what training computes with) are cast as
            with ``"bf16"``. See :mod:`faircast_dist.fp8`.
        fp8_scales: ``"channel"`` (default; one scale per output row, ``weight_scale [N, 1]``) or
            ``"block"`` (128x128, ``weight_scale_inv``).
        fp8_ue8m0: scales are powers of two.
        fp8_via_bf16: round the master to bf16 before the FP8 rounding (the stacks' double rounding;
            round-to-nearest only: for comparison).
        fp8_exclude: regex; params whose name it matches stay bf16 (default :data:`FP8_EXCLUDE`;
            ``""`` serves every 2-D ``*weight`` as FP8).
        fp8_rule: None (faircast's own sticky scales, set by ``fp8_scales`` / ``fp8_ue8m0``) or the name of a
            stack's quantizer (:data:`faircast_dist.fp8.PRESETS`: ``"verl"``, ``"vllm-fp8-per-channel"``, ...):
            scales and codes as that stack computes them, so ``mode "nearest"`` serves the stack's bytes (it rounds
            ``bf16(master)``, as the stack does) and a fair method changes only the rounding. It sets the scales:
            ``fp8_scales``, ``fp8_ue8m0`` and ``fp8_via_bf16`` stay unset.
        fp8_grid: with an ``fp8_rule`` whose scales are recomputed at every export (all but
            ``"deepseek-ue8m0"``): the model's bf16 params of the FP8 weights hold the served FP8 values
            ``bf16(q * s)`` after every export, in place of the bf16 cast of the masters, so a stack that
            quantizes those bf16 params with the rule's quantizer (verl, vLLM online) gets faircast's codes and
            scales back, bit for bit (the grid route: every group holds a ±448 code, and ``s`` is what the
            quantizer computes from ``bf16(448 s)``). The trainer then computes with the served FP8 values
            (trainer == rollout weights), which the install line says.

    Raises:
        ConfigError: (a ``ValueError``) naming the field and the bad value; ``.field`` is the field.
    """

    mode: str = "nearest"
    method: Method = Method.STOCHASTIC
    seed: int = 1234
    residual_dtype: str = "float32"
    format: Format = Format.BF16
    fp8_scales: str = "channel"
    fp8_ue8m0: bool = False
    fp8_via_bf16: bool = False
    fp8_exclude: str = FP8_EXCLUDE
    fp8_rule: str | None = None
    fp8_grid: bool = False

    def __post_init__(self):
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ConfigError(f"export_cast.mode must be one of {MODES}, got {self.mode!r}", "mode")
        try:  # held as the enum the kernels take ("error-feedback" too)
            method = Method(self.method)
        except ValueError:
            method = None
        if method is None or method is Method.NEAREST:
            raise ConfigError(f"export_cast.method must be one of {METHODS}, got {self.method!r}", "method")
        object.__setattr__(self, "method", method)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63:
            raise ConfigError(f"export_cast.seed must be an int64, got {self.seed!r}", "seed")
        if not isinstance(self.residual_dtype, str) or self.residual_dtype not in RESIDUAL_DTYPES:
            raise ConfigError(f"export_cast.residual_dtype must be one of {tuple(RESIDUAL_DTYPES)}, "
                              f"got {self.residual_dtype!r}", "residual_dtype")
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ConfigError(f"export_cast.format must be one of {FORMATS}, got {self.format!r}", "format")
        object.__setattr__(self, "format", Format(self.format))
        if not isinstance(self.fp8_scales, str) or self.fp8_scales not in FP8_SCALES:
            raise ConfigError(f"export_cast.fp8_scales must be one of {FP8_SCALES}, got {self.fp8_scales!r}",
                              "fp8_scales")
        for field in ("fp8_ue8m0", "fp8_via_bf16", "fp8_grid"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"export_cast.{field} must be true or false, got {getattr(self, field)!r}", field)
        try:
            re.compile(self.fp8_exclude)
        except (re.error, TypeError) as err:
            raise ConfigError(f"export_cast.fp8_exclude must be a regular expression, got {self.fp8_exclude!r}: "
                              f"{err}", "fp8_exclude") from None
        default = ExportCastConfig.__dataclass_fields__
        if self.fp8_rule is not None:
            from faircast_dist.fp8 import PRESETS
            if not isinstance(self.fp8_rule, str) or self.fp8_rule not in PRESETS:
                raise ConfigError(f"export_cast.fp8_rule must be one of {tuple(PRESETS)} (or unset: faircast's own "
                                  f"scales), got {self.fp8_rule!r}", "fp8_rule")
            for field in ("fp8_scales", "fp8_ue8m0", "fp8_via_bf16"):
                if getattr(self, field) != default[field].default:
                    raise ConfigError(f"export_cast.{field} is set but fp8_rule {self.fp8_rule!r} sets the scales "
                                      f"(and rounds bf16 under \"nearest\", as the stack does): leave {field} unset",
                                      field)
        if self.fp8_grid and (self.fp8_rule is None or self.scale_rule.sticky):
            raise ConfigError(f"export_cast.fp8_grid needs an fp8_rule whose scales are recomputed at every export "
                              f"(a stack's quantizer), got fp8_rule {self.fp8_rule!r}: sticky scales keep groups "
                              f"whose largest code is below 448, which the stack would rescale", "fp8_grid")
        if self.format != "fp8":
            for field in ("fp8_scales", "fp8_ue8m0", "fp8_via_bf16", "fp8_exclude", "fp8_rule", "fp8_grid"):
                if getattr(self, field) != default[field].default:
                    raise ConfigError(f"export_cast.{field} is set but format is {str(self.format)!r}: give "
                                      f"format \"fp8\" to serve FP8 weights", field)
        if self.fp8_via_bf16 and self.mode == "fair":
            raise ConfigError("export_cast.fp8_via_bf16 (the stacks' double rounding) is for round-to-nearest "
                              "(mode \"nearest\") only", "fp8_via_bf16")

    @property
    def enabled(self) -> bool:
        """True when an adapter installs: the cast is not plain round-to-nearest, or FP8 weights are served."""
        return self.mode == "fair" or self.fp8

    @property
    def fp8(self) -> bool:
        """FP8 weights are served (``format: "fp8"``)."""
        return self.format is Format.FP8

    @property
    def scale_rule(self):
        """The :class:`faircast_dist.fp8.ScaleRule` of the FP8 served weights: the ``fp8_rule`` preset, or faircast's
        own from ``fp8_scales`` / ``fp8_ue8m0``."""
        from faircast_dist.fp8 import PRESETS, ScaleRule
        return PRESETS[self.fp8_rule] if self.fp8_rule else ScaleRule(self.fp8_scales, self.fp8_ue8m0)

    @property
    def fp8_round_bf16(self) -> bool:
        """Round-to-nearest FP8 rounds ``bf16(master)``: ``fp8_via_bf16``, or an ``fp8_rule`` whose stack
        quantizes bf16 weights, under ``mode "nearest"``."""
        return self.fp8_via_bf16 or (self.mode == "nearest" and self.fp8 and self.scale_rule.bf16)

    @property
    def effective_method(self) -> Method:
        """What the cast really does: :attr:`Method.NEAREST` unless the mode is ``"fair"``."""
        return self.method if self.mode == "fair" else Method.NEAREST

    @classmethod
    def from_value(cls, value: Any) -> "ExportCastConfig":
        """Parse a config section: None (off), a mode string, or a dict of the fields above (an
        :class:`ExportCastConfig` is returned as it is).

        Raises:
            ConfigError: (a ``ValueError``) on an unknown key (named, with the allowed keys), a bad value,
                or a non-empty dict without ``"mode"`` (its other keys would be ignored).
            TypeError: when ``value`` is neither None, str, dict nor a config.
        """
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(mode=value)
        if not isinstance(value, dict):
            raise TypeError(f"export_cast must be a mode string or a dict, got {type(value).__name__}: {value!r}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown key(s) in export_cast: {unknown}; allowed keys are {allowed}")
        if value and "mode" not in value:  # {"method": "error_feedback"} alone would be stock, silently
            raise ConfigError(f"export_cast {value!r} has no \"mode\": give \"mode\": \"fair\" for Fair Cast "
                              "(or \"nearest\" for stock round-to-nearest)", "mode")
        return cls(**value)

    def to_dict(self) -> dict:
        """The fields as plain values (``{"mode": str, "method": str, "seed": int, "residual_dtype": str, ...}``)."""
        return {**dataclasses.asdict(self), "method": self.method.value, "format": self.format.value}


def env_config(environ=os.environ) -> ExportCastConfig | None:
    """The export-cast config ``FAIRCAST_EXPORT_CAST`` (in ``environ``) asks for, or None when it is
    unset or empty.

    Raises:
        ConfigError / TypeError: a bad value (the message names the variable and the key).
    """
    value = environ.get(ENV)
    if not value:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value  # a bare mode string
    try:
        return ExportCastConfig.from_value(parsed)
    except ConfigError as err:
        raise ConfigError(f"environment variable {ENV}={value!r}: {err}", err.field) from None
    except TypeError as err:
        raise TypeError(f"environment variable {ENV}={value!r}: {err}") from None
