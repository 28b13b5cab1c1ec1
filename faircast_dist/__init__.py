"""faircast_dist: framework-free Fair Cast (fp32 master -> bf16 model cast) core.

The casts exported here are the fast ones (:mod:`.fused`: the CPU kernel, Triton on a GPU);
:mod:`.rounding` keeps the plain-torch casts of the same names as the executable spec.

Modules: :mod:`.philox` (counter-based RNG), :mod:`.rounding` (the reference casts), :mod:`.fused`
(the kernels and their dispatch), :mod:`.shards`
(global element indices), :mod:`.caster` (config + step + residuals), :mod:`.config`,
:mod:`.telemetry`, :mod:`.delta` (delta export). Imports nothing from DeepSpeed or Megatron.
"""
from faircast_dist.caster import FairCaster
from faircast_dist.config import ExportCastConfig
from faircast_dist.philox import derive_dither_key, derive_key, philox4x32_10, random_bits16
from faircast_dist.fused import cast_error_feedback, cast_stochastic
from faircast_dist.rounding import cast_nearest
from faircast_dist.shards import block_index

__all__ = ["FairCaster", "ExportCastConfig", "derive_key", "derive_dither_key", "philox4x32_10", "random_bits16",
           "cast_nearest", "cast_stochastic", "cast_error_feedback", "block_index"]
