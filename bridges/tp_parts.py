"""Tensor-parallel layout of tensors fused from parts (a Mamba or GDN in_proj, their conv1d):
each TP rank holds its slice of every part, in order.

In:  the global tensor and its parts' global sizes along dim 0, or the TP ranks' local tensors.
Out: the TP ranks' local tensors (`split_parts`), or the global tensor (`merge_parts`);
     `FusedPartsTP`, the mixin that makes an mbridge bridge split / merge such tensors so.
"""

from __future__ import annotations

import torch


def split_parts(weight: torch.Tensor, parts: list[int], tp: int) -> list[torch.Tensor]:
    pieces = [p.chunk(tp) for p in weight.split(parts)]
    return [torch.cat([piece[r] for piece in pieces]) for r in range(tp)]


def merge_parts(local: list[torch.Tensor], parts: list[int]) -> torch.Tensor:
    tp = len(local)
    per_rank = [w.split([s // tp for s in parts]) for w in local]
    return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(parts))])


class FusedPartsTP:
    """Mix into an mbridge bridge (before LLMBridge) whose tensors fuse parts: `_tp_parts(name)`
    gives a tensor's parts' global sizes (None: not fused), `TP_VECTORS` the name endings of
    TP-split per-head vectors (megatron tags them without a partition dim), merged by concatenation."""

    TP_VECTORS: tuple[str, ...] = ()

    def _tp_parts(self, name: str) -> list[int] | None:
        return None

    def _weight_split_across_tp(self, name, weights, param, tp_split_size):
        parts = self._tp_parts(name)
        if parts is None or tp_split_size == 1:
            return super()._weight_split_across_tp(name, weights, param, tp_split_size)
        return split_parts(weights, parts, tp_split_size)

    def _weight_merge_across_tp(self, name, weights, param):
        if self.mpu.tp_size == 1:
            return super()._weight_merge_across_tp(name, weights, param)
        parts = self._tp_parts(name)
        if parts is not None:
            return merge_parts(weights, parts)
        if name.endswith(self.TP_VECTORS):
            return torch.cat(weights)
        return super()._weight_merge_across_tp(name, weights, param)
