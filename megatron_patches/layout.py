"""Where a rank's model param sits in the full model: canonical name and global element indices.

The source of truth is the model's own ``sharded_state_dict()`` — the metadata Megatron's
dist-checkpointing uses to move tensors between TP/PP/DP layouts. For each param it gives a
``ShardedTensor`` (or, for SwiGLU ``linear_fc1``, a ``ShardedTensorFactory`` whose halves are
sharded separately) with:

* ``key``: the param's checkpoint key; layers are stacked, e.g.
  ``decoder.layers.self_attention.linear_qkv.weight`` for every layer;
* ``prepend_axis_num`` leading axes (the global layer number under PP) and
  ``global_shape`` / ``global_offset``: where the TP-local block sits in the full tensor.

From that, for every TP-local param:

* **canonical name** = the key with the global layer number put back after ``layers.``
  (``decoder.layers.3.self_attention.linear_qkv.weight``), leading ``module.`` removed. It is the
  same on every rank and layout; a PP stage's local ``layers.0`` gets its global number; the
  last stage's copy of tied embeddings is named ``embedding.word_embeddings.weight`` like the
  first stage's (Megatron's checkpoint key for it), so both copies round identically. A MoE
  expert's key has a second stacked axis (its only one where Megatron numbers the layer in the
  key: non-homogeneous layers, MTP), the global expert number, which goes after the key's last
  ``experts.`` (``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight``: the key Megatron
  gives one expert with ``singleton_local_shards``, SequentialMLP's and GroupedMLP's alike),
  whichever EP rank holds it.
* **global element index** of a local element = its row-major flat index in the full param
  (per layer, without the layer axis). Vocab padding rows sit at the end of dim 0, so real rows
  keep their indices whatever the padding.

A param is described by its :class:`Block` list: contiguous runs of the flattened TP-local param
that are each a dense block of the full param (one block for a plain TP shard, two for SwiGLU).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import torch

from faircast_dist.fp8 import FusedRows
from faircast_dist.shards import block_index, index_runs
from megatron_patches.compat import ShardedTensor, ShardedTensorFactory

_LAYERS = re.compile(r"(^|\.)layers\.(?!\d+\.)")  # "layers." without its number: the layers are stacked
_EXPERTS = re.compile(r"(^|\.)experts\.(?!(.*\.)?experts\.)")  # the last "experts." segment: the expert axis


@dataclasses.dataclass(frozen=True)
class Block:
    """A run ``[start, start + numel)`` of the flattened TP-local param that is a dense block.

    ``global_shape``/``offset``/``local_shape`` describe the block inside the full param
    (row-major, no layer axis).
    """

    start: int
    global_shape: tuple
    offset: tuple
    local_shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def contiguous(self) -> bool:
        """True when the block is one contiguous run of global indices (split on dim 0 only)."""
        return tuple(self.local_shape[1:]) == tuple(self.global_shape[1:])

    @property
    def base(self) -> int:
        """Global flat index of the block's first element."""
        index, stride = 0, 1
        for g, o in zip(reversed(self.global_shape), reversed(self.offset)):
            index += o * stride
            stride *= g
        return index


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Canonical name and blocks of one TP-local model param (see the module docstring)."""

    name: str
    numel: int
    blocks: tuple

    def index(self, start: int, end: int, device=None) -> torch.Tensor | int:
        """Global element indices of elements ``[start, end)`` of the flattened TP-local param.

        Returns:
            an int (the global index of element ``start``) when the run is contiguous in the full
            param, else an int64 tensor of shape ``(end - start,)``.
        """
        parts = []
        for b in self.blocks:
            lo, hi = max(start, b.start), min(end, b.start + b.numel)
            if lo >= hi:
                continue
            if b.contiguous:
                if lo == start and hi == end:
                    return b.base + (lo - b.start)
                parts.append(torch.arange(lo - b.start, hi - b.start, dtype=torch.int64, device=device)
                             + b.base)
                continue
            parts.append(block_index(b.global_shape, b.offset, b.local_shape, device, (lo - b.start, hi - b.start)))
        return torch.cat(parts)

    def runs(self, start: int, end: int, chunk: int = 1 << 22) -> list[tuple[int, int, int]]:
        """Elements ``[start, end)`` as runs of consecutive global indices (fused-cast segments).

        Returns:
            ``[(offset from start, numel, global index of the run's first element), ...]``; one
            run for a contiguous block, one per row for a block split on a later dim. ``index``
            tensors are built ``chunk`` elements at a time to bound the int64 temporaries.
        """
        rows = []
        for lo in range(start, end, chunk):
            hi = min(lo + chunk, end)
            index = self.index(lo, hi)
            part = [(lo - start, hi - lo, index)] if isinstance(index, int) else \
                [tuple(r) for r in index_runs(index, lo - start).tolist()]
            for offset, numel, first in part:
                if rows and rows[-1][0] + rows[-1][1] == offset and rows[-1][2] + rows[-1][1] == first:
                    rows[-1] = (rows[-1][0], rows[-1][1] + numel, rows[-1][2])  # a run cut by a chunk
                else:
                    rows.append((offset, numel, first))
        return rows


def _strip(key: str) -> str:
    while key.startswith("module."):
        key = key[len("module."):]
    return key


def canonical_name(sh: ShardedTensor) -> str:
    """Canonical param name of a model ShardedTensor (see the module docstring)."""
    key, axes = _strip(sh.key), list(sh.global_offset[:sh.prepend_axis_num])
    # the prepended axes, in order: the layer's where the key has "layers." without a number (stacked layers;
    # non-homogeneous ones, e.g. a moe_layer_freq list, and MTP layers are numbered in the key), then the expert's
    if axes and _LAYERS.search(key):
        layer = axes.pop(0)
        key = _LAYERS.sub(lambda m: f"{m.group(1)}layers.{layer}.", key, count=1)
    if axes and _EXPERTS.search(key):
        expert = axes.pop(0)
        key = _EXPERTS.sub(lambda m: f"{m.group(0)}{expert}.", key, count=1)
    # another stacking Fair Cast does not know: any fixed spelling of the offsets will do (such a param is never
    # FP8, its name not ending in "weight", and served_weights refuses it)
    return f"{key}@{','.join(str(o) for o in axes)}" if axes else key


def _flat_start(param: torch.Tensor, part: torch.Tensor) -> int:
    if not part.is_contiguous():
        raise NotImplementedError(f"a non-contiguous shard of {tuple(param.shape)} in the model's "
                                  "sharded_state_dict; Fair Cast cannot map it")
    return (part.data_ptr() - param.data_ptr()) // param.element_size()


def _sharded_tensors(x) -> list:
    if isinstance(x, ShardedTensor):
        return [x]
    values = x.values() if isinstance(x, dict) else x
    return [sh for v in values for sh in _sharded_tensors(v)]


def describe(param: torch.Tensor, entry) -> ParamLayout:
    """The :class:`ParamLayout` of ``param`` from its entry in the model's sharded_state_dict.

    Args:
        param: the TP-local model param (the entry's ``data``).
        entry: its ``ShardedTensor`` or ``ShardedTensorFactory``.

    Raises:
        NotImplementedError: for shardings Fair Cast cannot map (flattened ranges, factories
            whose parts have different keys, parts that do not tile the param).
    """
    parts = _sharded_tensors(entry.build() if isinstance(entry, ShardedTensorFactory) else entry)
    names = {canonical_name(sh) for sh in parts}
    if len(names) != 1 or any(getattr(sh, "flattened_range", None) is not None for sh in parts):
        raise NotImplementedError(f"param {canonical_name(parts[0])!r}: unsupported sharding "
                                  f"(keys {sorted(names)}) for Fair Cast")
    blocks = []
    for sh in parts:
        p = sh.prepend_axis_num
        blocks.append(Block(_flat_start(param, sh.data), tuple(sh.global_shape[p:]),
                            tuple(sh.global_offset[p:]), tuple(sh.data.shape)))
    blocks.sort(key=lambda b: b.start)
    covered = 0
    for b in blocks:
        if b.start != covered:
            raise NotImplementedError(f"param {names.pop()!r}: sharded parts do not tile the param")
        covered += b.numel
    if covered != param.numel():
        raise NotImplementedError(f"param {names.pop()!r}: sharded parts cover {covered} of "
                                  f"{param.numel()} elements")
    return ParamLayout(names.pop(), param.numel(), tuple(blocks))


def model_entries(model_chunks: Sequence[torch.nn.Module], sharded_state_dict=None) -> dict:
    """``{id(param): ShardedTensor or factory}`` for every param of the model chunks.

    Args:
        model_chunks: the model chunks as handed to ``get_megatron_optimizer`` (DDP-wrapped).
        sharded_state_dict: a model sharded state dict to read instead of building one (for
            several chunks, a list with one per chunk, or the merged dict).
    """
    if sharded_state_dict is None:
        sharded_state_dict = [chunk.sharded_state_dict() for chunk in model_chunks]
    entries = {}

    def visit(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)):
            if isinstance(x.data, torch.Tensor):
                entries[id(x.data)] = x
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(sharded_state_dict)
    return entries


def describe_model(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """``{id(param): ParamLayout}`` for every trainable param of the model chunks.

    Raises:
        ValueError: a trainable param missing from the model's sharded_state_dict (named).
    """
    entries = model_entries(model_chunks)
    layouts = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            entry = entries.get(id(param))
            if entry is None:
                raise ValueError(f"Fair Cast: param {name!r} is not in the model's sharded_state_dict(), "
                                 "so its global name and element indices are unknown")
            layouts[id(param)] = describe(param, entry)
    return layouts


def fused_rows(name: str, shape: Sequence[int], config) -> FusedRows | None:
    """How a fused param's rows map onto the checkpoint's tensors (for FP8 128x128 block scales, which are defined
    on those): Megatron's ``linear_qkv`` ``[G (q + 2) d, H]`` holds, per query group ``g``, its ``q`` query heads'
    rows, then its key head's, then its value head's (``q_proj``, ``k_proj``, ``v_proj`` rows ``g q d``, ``g d``,
    ``g d``: ``SelfAttention.get_query_key_value_tensors`` in megatron/core/transformer/attention.py); a
    cross-attention ``linear_kv`` ``[2 h d, H]`` holds, per head, its key rows then its value rows (``k_proj``,
    ``v_proj``; ``CrossAttention.get_query_key_value_tensors``, which refuses grouped queries); a SwiGLU
    ``linear_fc1`` (``gated_linear_unit``) is ``[gate; up]``. Other params: None.

    Args:
        name: the canonical name (:class:`ParamLayout`).
        shape: the param's full shape ``[N, K]``.
        config: the model's ``TransformerConfig`` (``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
            ``gated_linear_unit``).

    Raises:
        NotImplementedError: ``attention_output_gate`` (its ``linear_qkv`` holds gate rows too), or a
            ``linear_qkv`` whose rows are not ``G (q + 2) d`` or a ``linear_kv`` whose rows are not ``2 h d``
            (named).
    """
    if name.endswith("self_attention.linear_qkv.weight"):
        if getattr(config, "attention_output_gate", False):
            raise NotImplementedError(f"export_cast FP8 block scales: {name!r} with attention_output_gate")
        groups = config.num_query_groups or config.num_attention_heads
        q, d = config.num_attention_heads // groups, config.kv_channels
        if shape[0] != groups * (q + 2) * d:
            raise NotImplementedError(f"export_cast FP8 block scales: {name!r} has {shape[0]} rows, not "
                                      f"{groups} query groups x ({q} + 2) x {d} (another fused layout)")
        return FusedRows([piece for g in range(groups)
                          for piece in ((0, g * q * d, q * d), (1, g * d, d), (2, g * d, d))])
    if name.endswith("cross_attention.linear_kv.weight"):
        heads, d = config.num_attention_heads, config.kv_channels
        if shape[0] != heads * 2 * d:
            raise NotImplementedError(f"export_cast FP8 block scales: {name!r} has {shape[0]} rows, not "
                                      f"{heads} heads x 2 x {d} (another fused layout)")
        return FusedRows([piece for h in range(heads) for piece in ((0, h * d, d), (1, h * d, d))])
    if name.endswith("linear_fc1.weight") and config.gated_linear_unit:
        return FusedRows([(0, 0, shape[0] // 2), (1, 0, shape[0] // 2)])
    return None
