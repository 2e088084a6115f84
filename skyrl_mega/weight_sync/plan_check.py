"""The per-sync check of the bucket plan: still valid on every rank, or rebuilt (planner.py)?

In: the model chunks of this rank, the bridge and the bucket size; on global rank 0 the bucket
order the sending transport wants. Out: the plan every rank agrees on for this sync (`plan()`,
one small CPU flag round), and the sync's CheckedParams: this rank's tensors looked up by name
when a bucket reads them, checked against the plan's shapes and dtypes, and swept all at once
after the last bucket. A mismatch anywhere makes the sync abort before its commit; the next
attempt (sync_weights) runs on a rebuilt plan.

Nothing is looked up or compared in `plan()`: touching every tensor costs about a microsecond
each on the critical path (1-2 ms for 2000 tensors on an H200 host right after a blocking
wait). The only tensors kept across syncs are the exporter's cached direct experts
(export.py), and each sweep checks that they still sit where the parameters are.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .collectives import FlagRound
from .params import ParamIndex
from .plan import BUCKET_ORDERS, BucketPlan
from .planner import build_plan


class PlanCheck:
    """The plan of one (bridge, models, bucket size), verified on every sync (see module doc)."""

    def __init__(self, bridge, models, bucket_bytes: int, flags: FlagRound):
        self.bridge = bridge
        self.models = models
        self.bucket_bytes = int(bucket_bytes)
        self.flags = flags
        self.current: BucketPlan | None = None
        self.index: ParamIndex | None = None
        self._sig = None  # (index, shapes) the plan was built for
        self._invalid = False  # set by invalidate(): rebuild on the next plan()
        self.rebuilds = 0
        self.flag_round_at: tuple[float, float] = (0.0, 0.0)  # (before, after) the last flag round

    def plan(self, first: str | None = None) -> tuple[BucketPlan, bool]:
        """(the plan for this sync, whether it was rebuilt). Every rank calls (one CPU flag
        round); rebuilt when it is missing, the previous sync found a changed shape/dtype
        (`invalidate`), or global rank 0 asks for another bucket order (`first`: the sending
        transport's preference, see planner.build_plan)."""
        stale = self.current is None or self.index is None or self._sig is None or self._invalid
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        want = BUCKET_ORDERS.index(first) + 1 if rank0 and first is not None else 0
        t1 = time.perf_counter()
        stale, want = self.flags.max(int(stale), want)
        self.flag_round_at = (t1, time.perf_counter())
        order = BUCKET_ORDERS[want - 1] if want else (self.current.first if self.current is not None else "experts")
        if stale or self.current.first != order:
            stale = 1
            self.index = ParamIndex(self.models)  # a full traversal whenever anything changed
            ts = self.index.lookup()
            self.current = build_plan(self.bridge, self.models, self.bucket_bytes, first=order)
            self._sig = (self.index, ParamIndex.shapes(ts))
            self._invalid = False
            self.rebuilds += 1
        return self.current, bool(stale)

    def invalidate(self) -> None:
        """Every rank: the next plan() rebuilds the plan (a sync saw a changed shape or dtype)."""
        self._invalid = True

    def params(self) -> "CheckedParams":
        """This sync's view of the tensors (looked up by name, checked against the plan)."""
        return CheckedParams(self.index, self._sig[1])


class CheckedParams:
    """params[(vpp, name)] -> the tensor, looked up by name from its owner now, and checked
    against the plan's shape and dtype.

    A tensor that is gone or does not match sets `stale`, and zeros of the planned shape are
    handed out instead, so every collective of the sync still matches across ranks; the sync
    then aborts before its commit (sync_weights) and runs again on a rebuilt plan."""

    __slots__ = ("index", "expect", "stale")

    def __init__(self, index: ParamIndex, expect: list):
        self.index, self.expect, self.stale = index, expect, False

    def _zeros(self, i: int, like) -> torch.Tensor:
        self.stale = True
        shape, dtype = self.expect[i]
        return torch.zeros(shape, dtype=dtype, device=like.device if like is not None else None)

    def __getitem__(self, key):
        i = self.index.pos[key]
        t = self.index.get(i)
        if t is None:
            return self._zeros(i, None)
        shape, dtype = self.expect[i]
        if t.shape != shape or t.dtype != dtype:
            return self._zeros(i, t)
        return t

    def raw(self, key):
        """Looked up, not checked (the sweep after the last bucket checks it)."""
        i = self.index.pos[key]
        t = self.index.get(i)
        return t if t is not None else self._zeros(i, None)

    def positions(self, keys) -> tuple[int, ...]:
        """Where `keys` sit in the index, i.e. in sweep()'s lookup (stable while the plan is)."""
        return tuple(self.index.pos[k] for k in keys)

    def sweep(self) -> tuple[bool, list[torch.Tensor] | None]:
        """After the last bucket: (is any of this rank's tensors gone, reshaped or retyped, the
        fresh lookup of all of them when none is). One C-level pass over all of them, while the
        GPU / the engines still work on the buckets."""
        if self.stale:
            return True, None
        try:
            ts = self.index.lookup()
        except KeyError:
            return True, None
        if ParamIndex.shapes(ts) != self.expect:
            return True, None
        return False, ts
