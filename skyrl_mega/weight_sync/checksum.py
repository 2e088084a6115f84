"""Per-tensor checksums over raw bytes, identical on CPU and GPU (integer sums, order-free).

A tensor's checksum is two int64 numbers over its bytes b[0..n):
    s1 = sum(b)                                   (catches any change of value)
    s2 = sum_r (r % 65521 + 1) * sum(b in row r)  (rows of 1024 bytes: catches moved bytes)
Integer reductions do not depend on the reduction order, so a sender on one GPU, a receiver
on another and a CPU test all get the same numbers. Tensors of equal byte size that sit back
to back in a buffer (one layer's experts) are checksummed by one batched reduction.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

ROW = 1024
MOD = 65521


def _rows_weights(n_rows: int, device) -> torch.Tensor:
    return torch.arange(n_rows, device=device, dtype=torch.int64) % MOD + 1


def checksum_rows(region: torch.Tensor) -> torch.Tensor:
    """region: uint8 [k, n] (k tensors of n bytes each) -> int64 [k, 2]."""
    k, n = region.shape
    full = n // ROW
    out = torch.zeros(k, 2, dtype=torch.int64, device=region.device)
    if full:
        rs = region[:, : full * ROW].reshape(k, full, ROW).sum(-1, dtype=torch.int64)
        out[:, 0] += rs.sum(-1)
        out[:, 1] += (rs * _rows_weights(full, region.device)).sum(-1)
    if n % ROW:
        tail = region[:, full * ROW :].sum(-1, dtype=torch.int64)
        out[:, 0] += tail
        out[:, 1] += tail * (full % MOD + 1)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (a copy only if t is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] checksum of one tensor's bytes."""
    return checksum_rows(as_bytes(t)[None])[0]


def buffer_checksums(buf: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Checksums of byte spans (offset, nbytes) of a uint8 buffer -> int64 [len(spans), 2].

    Runs of equal-size, back-to-back spans are reduced together (one kernel pair per run).
    """
    out = torch.empty(len(spans), 2, dtype=torch.int64, device=buf.device)
    i = 0
    while i < len(spans):
        off, n = spans[i]
        j = i + 1
        while j < len(spans) and spans[j][1] == n and spans[j][0] == off + (j - i) * n:
            j += 1
        out[i:j] = checksum_rows(buf[off : off + (j - i) * n].view(j - i, n))
        i = j
    return out


def digest(checksums: torch.Tensor) -> str:
    """One hex digest of a [T, 2] checksum table (the model's fingerprint for reports)."""
    return hashlib.sha256(checksums.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
