"""The torch device this process computes on: its current CUDA device, or the CPU without CUDA.

In: nothing (torch's CUDA state). Out: a torch.device. The project's one cuda-or-cpu choice.
"""

from __future__ import annotations

import torch


def current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
