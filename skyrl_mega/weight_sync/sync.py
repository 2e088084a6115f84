"""Trainer -> engines weight sync: export HF-named tensors from Megatron, bucket, transport.

In: the policy's bridge + model chunks (every rank calls: the export gathers TP/EP/PP shards
with one coalesced collective per bucket, see export.py), a WeightTransport on rank 0 (None
elsewhere) and a version number. Out: every engine serving the trainer's weights under that
version, or WeightSyncError on every trainer rank (engines paused on their old version).

Transports:
- BucketTransport (nccl.NcclBroadcastTransport, cuda_ipc.CudaIpcTransport): packed buckets
  straight from the exporter's buffers; the plan (names, dtypes, shapes, offsets) goes to the
  engines once per sync.
- any other WeightTransport (the CPU SharedMemoryTransport): gets each bucket as (name, tensor)
  views of the packed buffer through send().
The bucket plan is built once and verified against every tensor on every sync, before the
commit (export.BucketExporter); a sync that finds it stale is aborted and sent again on a
rebuilt plan.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import torch.distributed as dist

from ..rollout.errors import WeightSyncError
from .base import BucketTransport
from .export import get_exporter
from .plan import DEFAULT_BUCKET_BYTES, bucket_tensors

logger = logging.getLogger(__name__)

# Python's GIL switch interval while a sync runs (seconds; None: leave the interpreter's, 5 ms).
# The transports talk to the engines from background threads (rounds, update_weights) while
# the main thread walks the buckets, which holds the GIL almost all the time: at 5 ms, the first
# round of a co-located IPC sync reached the engine 4.3 ms after it was posted (H200 timelines,
# BENCHMARKS.md "IPC profiling").
GIL_SWITCH_S: float | None = 2e-4


@contextlib.contextmanager
def _gil_handoff():
    old = sys.getswitchinterval()
    if GIL_SWITCH_S is not None:
        sys.setswitchinterval(min(old, GIL_SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def sync_weights(bridge, models, transport, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 gather: str = "auto") -> dict:
    """Collective over all trainer ranks. Returns timing/size metrics (rank 0's are real).
    `gather`: how expert shards reach rank 0 ("auto": CUDA IPC reads within a host, else NCCL).

    A sync during which some rank saw a parameter with another shape or dtype than the plan
    (export.BucketExporter) is aborted before its commit (the engines keep the old version)
    and sent once more on a rebuilt plan."""
    t0 = time.perf_counter()
    ex = get_exporter(bridge, models, bucket_bytes, gather)
    for attempt in range(2):
        with _gil_handoff():
            out = _sync_once(ex, transport, version)
        if out is not None:
            seconds = time.perf_counter() - t0
            out["weight_sync/seconds"] = seconds
            out["weight_sync/stale_retries"] = float(attempt)
            if transport is not None and (not dist.is_initialized() or dist.get_rank() == 0):
                out["weight_sync/GBps"] = out["weight_sync/bytes"] / seconds / 1e9
            return out
        logger.info("weight sync %s: a parameter changed shape or dtype; sending again on a new plan", version)
        ex.invalidate()
    raise WeightSyncError(f"weight sync {version}: parameters changed shape or dtype while it ran, twice")


def _sync_once(ex, transport, version: int) -> dict | None:
    """One attempt (every rank). None: some rank saw a stale plan; nothing was committed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    t0 = time.perf_counter()
    plan = ex.plan(first=getattr(transport, "bucket_first", None) if rank == 0 else None)
    t_plan = time.perf_counter() - t0
    sending = rank == 0 and transport is not None
    bucketed = sending and isinstance(transport, BucketTransport)
    layout = transport.layout if bucketed else "full"
    failure: BaseException | None = None
    if sending:
        try:
            transport.start(version, plan) if bucketed else transport.start(version)
        except BaseException as e:
            failure = e
    acquire = transport.acquire if bucketed and failure is None else None
    n = 0
    for b, buf, direct in ex.iter_buckets(acquire=acquire, layout=layout, plan=plan):
        if not sending or failure is not None:
            continue  # keep taking part in the export collectives
        try:
            if bucketed:
                transport.send_bucket(b, buf, direct)
            else:
                transport.send(bucket_tensors(b, buf, direct))
            n += 1
        except BaseException as e:
            failure = e
    stale = ex.stale_seen  # agreed by every rank at the end of iter_buckets
    report = None
    if sending and failure is None and not stale:
        try:
            report = transport.finish()
        except BaseException as e:
            failure = e
    if sending and (failure is not None or stale):
        try:
            transport.abort()
        except Exception:
            logger.exception("abort after a failed weight sync")
    if stale:
        return None
    # every trainer rank learns whether the sync failed (a CPU collective: see flag_max)
    failed = ex.flags.max(int(failure is not None))
    if failure is not None:
        if isinstance(failure, WeightSyncError):
            raise failure
        raise WeightSyncError(f"weight sync {version} failed: {failure!r}") from failure
    if failed:
        raise WeightSyncError(f"weight sync {version} failed on trainer rank 0")
    out = {"weight_sync/plan_seconds": t_plan,
           "weight_sync/bytes": float(plan.total_bytes), "weight_sync/tensors": float(plan.num_tensors),
           "weight_sync/buckets": float(len(plan.buckets)), "weight_sync/plan_rebuilds": float(ex.rebuilds)}
    out.update({f"weight_sync/{k}": v for k, v in ex.plan_timings.items()})
    if sending:
        for k, v in getattr(transport, "timings", {}).items():
            out[f"weight_sync/{k}"] = v
    if report is not None:
        transport.last_report = report
    return out
