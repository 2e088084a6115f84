"""Tensor-parallel layout of tensors fused from parts (a Mamba or GDN in_proj, their conv1d):
each TP rank holds its slice of every part, in order.

In:  the global tensor and its parts' global sizes along dim 0, or the TP ranks' local tensors.
Out: the TP ranks' local tensors (`split_parts`), or the global tensor (`merge_parts`).
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
