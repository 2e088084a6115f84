"""Trainer -> engines weight sync: export HF-named tensors from Megatron, bucket, transport.

In: the policy's bridge + model chunks (every rank calls: the export gathers TP/EP/PP shards
with collectives), a WeightTransport on rank 0 (None elsewhere) and a version number.
Out: every engine serving the trainer's weights under that version. Buckets are filled up to
`bucket_bytes`; a bucket is sent as soon as it is full, so peak extra memory is one bucket.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 1 << 30


def sync_weights(bridge, models, transport, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Collective over all trainer ranks. Returns timing/size metrics (rank 0's are real)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    t0 = time.perf_counter()
    sending = rank == 0 and transport is not None
    if sending:
        transport.start(version)
    bucket, size, total, n = {}, 0, 0, 0
    try:
        for name, tensor in bridge.export_hf(models):
            if not sending:
                continue
            t = tensor.detach().to("cpu", copy=True).contiguous()
            bucket[name] = t
            size += t.numel() * t.element_size()
            n += 1
            if size >= bucket_bytes:
                transport.send(list(bucket.items()))
                total += size
                bucket, size = {}, 0
        if sending:
            if bucket:
                transport.send(list(bucket.items()))
                total += size
            transport.finish()
    except BaseException:
        if sending:
            transport.abort()
        raise
    return {"weight_sync/seconds": time.perf_counter() - t0, "weight_sync/bytes": float(total),
            "weight_sync/tensors": float(n)}
