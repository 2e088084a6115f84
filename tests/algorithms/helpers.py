"""Shared test helpers: deterministic float64 data and batch splitting."""

from __future__ import annotations

import torch

B, T = 8, 7
# Valid-token layout of the global batch: varied lengths, an all-pad row (2), a hole (row 0).
LENGTHS = [7, 3, 0, 5, 1, 7, 2, 4]


def make_mask() -> torch.Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    mask[0, 2] = False  # e.g. a masked tool-output token inside a response
    return mask


def rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=rng(seed), dtype=torch.float64) * scale


# Row pieces of the global batch; gradients of the pieces must add up to the full-batch one.
SPLITS = {
    "1x8": [[0, 1, 2, 3, 4, 5, 6, 7]],
    "4x2": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "8x1": [[i] for i in range(B)],
    # 2 data-parallel ranks holding interleaved rows, 2 micro-batches each.
    "2dp_x_2mb": [[0, 2], [4, 6], [1, 3], [5, 7]],
}


def trimmed_columns(mask: torch.Tensor, rows: list[int]) -> slice:
    """Columns a micro-batch really needs (padded only to its own longest response)."""
    valid_cols = mask[rows].any(0).nonzero()
    end = int(valid_cols.max()) + 1 if valid_cols.numel() else 1
    return slice(0, end)
