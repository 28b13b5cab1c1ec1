"""faircast_dist: framework-free Fair Cast (fp32 master -> bf16 model cast) core.

The casts exported here are the fast ones (:mod:`.fused`: the CPU kernel, Triton on a GPU);
:mod:`.rounding` keeps the plain-torch casts of the same names as the executable spec.

Modules: :mod:`.philox` (counter-based RNG), :mod:`.rounding` (the reference casts, bf16 and FP8), :mod:`.fp8` (FP8 scales), :mod:`.fused`
(the kernels and their dispatch), :mod:`.shards`
(global element indices), :mod:`.caster` (config + step), :mod:`.export` (one rank's export and its checkpoints: every adapter's), :mod:`.config`,
:mod:`.telemetry`, :mod:`.delta` (delta export). No module under it imports an adapter, a
framework (DeepSpeed, Megatron, FSDP's internals) or the launcher (:mod:`faircast_run`).

``__all__`` is what a user calls: the config, the caster, and the functional casts with the key
and global indices they take (``derive_key``, ``block_index``); the RNG's internals stay in :mod:`.philox`.
"""
from faircast_dist.caster import FairCaster
from faircast_dist.config import ConfigError, ExportCastConfig, Method
from faircast_dist.philox import derive_key
from faircast_dist.fused import cast_error_feedback, cast_stochastic
from faircast_dist.rounding import cast_nearest
from faircast_dist.shards import block_index

__all__ = ["ExportCastConfig", "Method", "ConfigError", "FairCaster", "cast_nearest", "cast_stochastic",
           "cast_error_feedback", "derive_key", "block_index"]
