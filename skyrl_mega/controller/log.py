"""One-line progress messages from global rank 0 (`[skyrl-mega] ...` on stdout)."""

from __future__ import annotations

import torch.distributed as dist


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[skyrl-mega] {msg}", flush=True)
