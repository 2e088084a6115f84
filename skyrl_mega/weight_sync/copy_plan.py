"""CopyPlan: unpack copies, received bytes -> a receiver's parameters (the vLLM engine, the stand-in).

In: per tensor, (source buffer key, byte offset, dtype) and (flat destination parameter,
first element, numel); at execute time the source buffers (a received bucket, or the buffers
opened through IPC handles). Out: the bytes copied, merged where both the source and the
destination ranges are back to back, and optional checksums of what landed (read back).
Chosen copy modes (strided chains, memcpy loop, _foreach_copy_, CUDA graphs) are measured by
bench/weight_sync_bench.py; tests/test_copy_plan.py checks them against per-tensor copies.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..rollout.errors import WeightSyncError
from . import row_copy
from .checksum import checksum_rows

logger = logging.getLogger(__name__)


def _index_select(d2: torch.Tensor, s2: torch.Tensor, rows: torch.Tensor) -> None:
    torch.index_select(s2, 0, rows, out=d2)


# how a strided chain (dst [k, n] block, src [*, n] row-strided view, row order) is copied, per mode
_COPIERS = {"index_select": _index_select, "row_copy": row_copy.copy_rows}


class CopyPlan:
    """Byte-range copies from received buffers into destination tensors, merged where both the
    source and the destination ranges are back to back (one layer's experts -> a few copies).
    The source/destination views are built once per set of source buffers and reused, so a
    sync costs a few launches per bucket, not Python work per tensor."""

    def __init__(self):
        self.runs: list[list] = []  # [src_key, src_off, dst_flat, dst_start, numel, dtype, [(slot, nbytes)..]]
        self._bound: tuple | None = None
        self._graph = None
        self.tuned: dict | None = None  # "auto" on CUDA: {mode: ms of one full copy, "chosen": mode}

    def add(self, src_key, src_off: int, dtype: torch.dtype, dst_flat: torch.Tensor, dst_start: int, numel: int,
            slot: int) -> None:
        nbytes = numel * dtype.itemsize
        if self.runs:
            r = self.runs[-1]
            if (r[0] == src_key and r[1] + r[4] * r[5].itemsize == src_off and r[2] is dst_flat
                    and r[3] + r[4] == dst_start and r[5] == dtype):
                r[4] += numel
                r[6].append((slot, nbytes))
                return
        self.runs.append([src_key, src_off, dst_flat, dst_start, numel, dtype, [(slot, nbytes)]])

    # runs at least this long are copied one copy_ (a memcpy) each; shorter ones together in one
    # _foreach_copy_ (one launch for many small tensors). Chosen by bench/weight_sync_bench.py.
    loop_min_bytes = 1 << 20
    # on CUDA, record the copies once per set of source buffers as a CUDA graph and replay it:
    # one launch instead of one per run. Off by default: with strided chains there are few
    # launches left, and on 2 x H200 the same copies without a graph were faster in each of five
    # runs (co-located sync, best of 3: 951-1196 vs 893-1123 GB/s), while the capture adds
    # 10-15 ms to the first sync of every plan (BENCHMARKS.md)
    use_graphs = False
    # runs of equal length whose destinations are back to back and whose sources sit at a constant
    # stride (either sign: one layer's experts in a DDP buffer, or in a packed bucket) become one
    # index_select into the destination block: a layer's gate_up / down experts in one kernel
    strided = True
    min_chain = 4
    # how a chain is copied on CUDA: "index_select" (one gather kernel per chain), "row_copy" (one
    # Triton copy kernel per chain, row_copy.py), "foreach" (its runs in the _foreach_copy_ lists:
    # vectorised multi-tensor copies) or "auto": the ways in WAYS timed once when the plan is
    # bound (the copies are idempotent), each then checked byte for byte against its sources, and
    # the fastest that landed the right bytes kept (`tuned`; a wrong one is logged and left out)
    chain_mode = "auto"
    # what "auto" times: (chain mode, whether runs of loop_min_bytes and more go one copy_ each
    # or into the _foreach_copy_ lists with the small ones: one launch instead of hundreds for a
    # round of many dense tensors)
    WAYS = {"index_select": ("index_select", True), "foreach": ("foreach", True),
            "index_select+foreach_big": ("index_select", False), "row_copy": ("row_copy", True),
            "row_copy+foreach_big": ("row_copy", False)}

    def _chains(self) -> tuple[list[tuple[list[list], int]], list[list]]:
        """([(runs of one strided chain, source stride in bytes)], the other runs)."""
        groups: dict = {}
        for r in self.runs:
            groups.setdefault((r[0], id(r[2]), r[4], r[5]), []).append(r)
        chains, rest = [], []
        for rs in groups.values():
            rs = sorted(rs, key=lambda r: r[3])
            i = 0
            while i < len(rs):
                j = i + 1
                stride = rs[j][1] - rs[i][1] if j < len(rs) else 0
                nbytes = rs[i][4] * rs[i][5].itemsize
                while (j < len(rs) and rs[j][3] == rs[j - 1][3] + rs[j - 1][4] and rs[j][1] - rs[j - 1][1] == stride
                       and abs(stride) >= nbytes):
                    j += 1
                if j - i >= self.min_chain:
                    chains.append((rs[i:j], stride))
                else:
                    rest.extend(rs[i:j])
                i = j
        return chains, rest

    @staticmethod
    def _strided_views(chain: list[list], stride: int, sources) -> tuple | None:
        """(dst [k, n], src [k, n] strided view, row index) in the widest element type that
        divides every offset and length; None if no such view exists."""
        first = chain[0]
        k, n, dt, dst = len(chain), first[4], first[5], first[2]
        nbytes = n * dt.itemsize
        lo = min(r[1] for r in chain)
        src = sources[first[0]]
        dst_block = dst[first[3]: first[3] + k * n]
        for w, edt in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)):
            if (nbytes % w or stride % w or (src.storage_offset() + lo) % w
                    or (dst_block.storage_offset() * dst.element_size()) % w):
                continue
            s = src.view(torch.uint8)[lo: lo + (k - 1) * abs(stride) + nbytes].view(edt)
            s2 = s.as_strided((k, nbytes // w), (abs(stride) // w, 1), s.storage_offset())
            d2 = dst_block.view(torch.uint8).view(edt).view(k, nbytes // w)
            rows = torch.arange(k, device=dst.device)
            return d2, s2, rows if stride > 0 else rows.flip(0)
        return None

    def bind(self, sources: dict[Any, torch.Tensor]) -> tuple:
        key = (tuple((k, v.data_ptr(), v.numel()) for k, v in sources.items()), self.loop_min_bytes, self.strided,
               self.chain_mode)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        chains, rest = self._chains() if self.strided else ([], self.runs)
        mode = self.chain_mode
        on_cuda = bool(self.runs) and self.runs[0][2].is_cuda
        if mode == "auto" and not on_cuda:
            mode = "index_select"
        if mode == "auto":
            runs_here = {"index_select": True, "foreach": bool(chains),
                         "row_copy": bool(chains) and row_copy.available(self.runs[0][2])}
            ways = {name: self._bound_as(m, chains, rest, sources, loop) for name, (m, loop) in self.WAYS.items()
                    if runs_here[m]}
            ways = {name: b for name, b in ways.items() if b is not None}
            self.tuned, wrong = {}, []
            for name, b in ways.items():
                self.tuned[name] = self._time(b)
                if not self._landed(sources):  # a way that lands other bytes is never chosen
                    wrong.append(name)
                    self.tuned[name] = float("inf")
            if wrong:
                logger.warning("copy plan: %s landed other bytes than the sources on this device; not used", wrong)
            self.tuned["chosen"] = min(ways, key=self.tuned.get)
            if self.tuned["chosen"] in wrong:
                raise WeightSyncError(f"no way of copying landed the right bytes here ({wrong})")
            bound = ways[self.tuned["chosen"]]
        else:
            bound = self._bound_as(mode, chains, rest, sources)
        self._bound = (key, bound)
        self._graph = None
        return bound

    def _bound_as(self, mode: str, chains, rest, sources, loop_big: bool = True) -> tuple | None:
        """(strided chains, big runs, foreach destinations, foreach sources) for one chain mode;
        loop_big False: no big runs (all in the foreach lists), None when there were none to move."""
        strided = []
        copier = _COPIERS.get(mode)
        for chain, stride in chains:
            v = self._strided_views(chain, stride, sources) if copier is not None else None
            if v is None:
                rest = rest + chain
            else:
                strided.append((*v, copier))
        big, dsts, srcs = [], [], []
        chained = {id(r) for c, _ in chains for r in c} if mode == "foreach" else set()
        any_big = False
        for r in rest:
            k, off, dst, start, n, dt, _ = r
            src, d = sources[k][off: off + n * dt.itemsize].view(dt), dst[start: start + n]
            if n * dt.itemsize >= self.loop_min_bytes and id(r) not in chained:
                any_big = True
                if loop_big:
                    big.append((d, src))
                    continue
            dsts.append(d)
            srcs.append(src)
        if not loop_big and not any_big:
            return None  # the same copies as the looped way
        return strided, big, dsts, srcs

    def _landed(self, sources) -> bool:
        """Every run's destination holds its source's bytes (after a timed copy; one sync)."""
        bad = None
        for k, off, dst, start, n, dt, _ in self.runs:
            nbytes = n * dt.itemsize
            diff = (dst[start: start + n].view(torch.uint8) != sources[k][off: off + nbytes].view(torch.uint8)).any()
            bad = diff if bad is None else bad | diff
        return bad is None or not bool(bad)

    def shape(self) -> dict:
        """What the bound plan launches: merged runs, bytes, strided chains, runs copied one by
        one, runs in the multi-tensor lists (for logs)."""
        out = {"runs": len(self.runs), "bytes": sum(r[4] * r[5].itemsize for r in self.runs)}
        if self._bound is not None:
            strided, big, dsts, _ = self._bound[1]
            out.update(chains=len(strided), looped=len(big), foreach=len(dsts))
        return out

    def _time(self, bound: tuple, reps: int = 2) -> float:
        """Milliseconds of the fastest of `reps` full copies through `bound` (CUDA)."""
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self._launch(*bound)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b))
        return best

    @staticmethod
    def _launch(strided, big, dsts, srcs) -> None:
        for d2, s2, rows, copier in strided:
            copier(d2, s2, rows)
        for d, src in big:
            d.copy_(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def execute(self, sources: dict[Any, torch.Tensor]) -> None:
        bound = self.bind(sources)
        if not (self.use_graphs and self.runs and self.runs[0][2].is_cuda):
            return self._launch(*bound)
        g = self._graph
        if g is None:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._launch(*bound)  # warm-up (the real copy: replaying it below is harmless)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._launch(*bound)
            except Exception as e:  # a graph is an optimisation: copy directly instead
                logger.warning("CUDA graph capture of the weight copies failed (%s); copying directly", e)
                self._graph = False
                return self._launch(*bound)
            self._graph = g
        if g is False:
            return self._launch(*bound)
        g.replay()

    def checksums(self, out: torch.Tensor, row_of: Callable[[int], int]) -> None:
        """Checksums of what landed in the destinations (read back), into out[row]."""
        for key, off, dst, start, n, dt, slots in self.runs:
            region = dst[start: start + n]
            if region.dtype != dt:
                raise WeightSyncError("read-back checksums need the wire dtype at the destination")
            b = region.view(torch.uint8)
            sizes = {s for _, s in slots}
            if len(sizes) == 1:
                size = sizes.pop()
                cs = checksum_rows(b.view(len(slots), size))
                for i, (slot, _) in enumerate(slots):
                    out[row_of(slot)] = cs[i]
            else:
                pos = 0
                for slot, size in slots:
                    out[row_of(slot)] = checksum_rows(b[pos: pos + size][None])[0]
                    pos += size
