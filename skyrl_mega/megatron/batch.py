"""RLBatch: the samples of one data-parallel rank for the RL train step.

In: per-sample 1-D tensors aligned with each sample's prompt+response tokens (index t = token
t): input_ids, response_mask, advantages (or one scalar per sample), rollout / ref / old
logprobs, routed experts [L or L-1, moe_layers, topk]. Out: validation with clear errors and
selection of a subset of samples (data-parallel sharding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor


@dataclass
class RLBatch:
    """Samples of one data-parallel rank (see module docstring for shapes)."""

    input_ids: list[Tensor]
    response_mask: list[Tensor]
    advantages: list[Tensor]
    rollout_logprobs: Optional[list[Tensor]] = None
    ref_logprobs: Optional[list[Tensor]] = None
    routed_experts: Optional[list[Optional[Tensor]]] = None
    old_logprobs: Optional[list[Tensor]] = None  # set by train_step (or the caller)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.input_ids]

    def select(self, indices: Sequence[int]) -> "RLBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]  # noqa: E731
        return RLBatch(**{f: pick(getattr(self, f)) for f in self.__dataclass_fields__})

    def validate(self) -> None:
        n = len(self.input_ids)
        for name in ("response_mask", "advantages", "rollout_logprobs", "ref_logprobs", "routed_experts",
                     "old_logprobs"):
            xs = getattr(self, name)
            if xs is not None and len(xs) != n:
                raise ValueError(f"RLBatch.{name} has {len(xs)} entries for {n} samples")
        for i, ids in enumerate(self.input_ids):
            if ids.dim() != 1 or ids.numel() < 2:
                raise ValueError(f"sample {i}: input_ids must be 1-D with >= 2 tokens, got {tuple(ids.shape)}")
            for name in ("response_mask", "rollout_logprobs", "ref_logprobs", "old_logprobs"):
                xs = getattr(self, name)
                if xs is not None and xs[i].shape != ids.shape:
                    raise ValueError(f"sample {i}: {name} {tuple(xs[i].shape)} != input_ids {tuple(ids.shape)}")
            adv = self.advantages[i]
            if adv.numel() != 1 and adv.shape != ids.shape:
                raise ValueError(f"sample {i}: advantages must be a scalar or [{ids.numel()}], got {tuple(adv.shape)}")
