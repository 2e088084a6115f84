"""Trainer -> engines weight sync, the orchestration: plan check -> fill buckets -> transport.

In: the policy's bridge + model chunks (every rank calls: the export gathers TP/EP/PP shards
with one coalesced collective per bucket), a WeightTransport on rank 0 (None elsewhere) and a
version number. Out: every engine serving the trainer's weights under that version, or
WeightSyncError on every trainer rank (engines paused on their old version).

One attempt, top to bottom (`_sync_once`):
1. the plan, agreed by every rank in one CPU flag round (plan_check.py); built once per model
   shape (planner.py), rebuilt only when a shape, a dtype or the wanted bucket order changed;
2. rank 0's transport starts the update (transports/: engines paused);
3. every rank walks the plan's buckets (export.py: gathers toward rank 0); rank 0 packs each
   into the buffer its transport hands out (`acquire`) and sends it (`send_bucket`);
4. after the last bucket every rank has swept its tensors against the plan: a change anywhere
   aborts the update before its commit (the engines keep the old version) and the sync runs
   once more on a rebuilt plan; otherwise the transport commits (`finish`);
5. every rank learns whether rank 0's transport failed (one more flag round).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import torch.distributed as dist

from ..rollout.errors import WeightSyncError
from .export import get_exporter
from .plan import DEFAULT_BUCKET_BYTES

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
    is aborted before its commit (the engines keep the old version) and sent once more on a
    rebuilt plan."""
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


def _attempt(fn, *args) -> BaseException | None:
    """fn(*args); the exception it raised, if any (rank 0 keeps taking part in the collectives)."""
    try:
        fn(*args)
    except BaseException as e:
        return e
    return None


def _sync_once(ex, transport, version: int) -> dict | None:
    """One attempt (every rank). None: some rank saw a stale plan; nothing was committed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sending = rank == 0 and transport is not None
    # 1. the plan of this sync (every rank)
    t0 = time.perf_counter()
    plan = ex.plan(first=transport.bucket_first if sending else None)
    t_plan = time.perf_counter() - t0
    # 2. the update begins
    failure = _attempt(transport.start, version, plan) if sending else None
    # 3. buckets: filled by every rank, sent by rank 0 (after a failure it only keeps exporting)
    acquire = transport.acquire if sending and failure is None else None
    layout = transport.layout if sending else "full"
    for b, buf, direct in ex.iter_buckets(acquire=acquire, layout=layout, plan=plan):
        if sending and failure is None:
            failure = _attempt(transport.send_bucket, b, buf, direct)
    # 4. commit, unless something failed or some rank saw a stale plan
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
    # 5. every trainer rank learns whether the sync failed (a CPU collective: see FlagRound)
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
        out.update({f"weight_sync/{k}": v for k, v in transport.timings.items()})
    if report is not None:
        transport.last_report = report
    return out
