"""Sequence packing (THD) and token-budget micro-batches.

In:  per-sample 1-D tensors (token ids, masks, logprobs, routes ...) of mixed lengths, the
     TP / CP sizes, and a token budget per micro-batch.
Out: `MicroBatchLayout`s: where every token of every sample sits in a micro-batch tensor
     [rows, width], the cu_seqlens / cu_seqlens_padded and `PackedSeqParams` of a packed row,
     position ids that restart per sequence, and scatter / gather between per-sample tensors
     and micro-batch tensors (`unpack` is exact: it returns the per-sample tensors).

Two layouts, one interface:
  packed  (THD) one row per micro-batch (rows=1); sample i occupies
          [cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i) and is followed by padding up to a
          multiple of `pad_multiple(tp, cp)` (TP for the sequence-parallel split, 2*CP*TP under
          context parallelism so that every zig-zag chunk is a whole number of SP slices).
  padded  (BSHD) one sample per row, every row padded to the same width (a multiple of TP);
          the baseline the packing benchmark compares against.

Position convention: micro-batch position ``start_i + t`` holds token t of sample i; the
logits at that position predict token t+1 (`next_token_labels`, `prediction_index`).

Attention on packed rows: with transformer-engine, megatron's TEDotProductAttention consumes
`PackedSeqParams` (qkv_format='thd') directly. megatron-core's local DotProductAttention
asserts `packed_seq_params is None`; skyrl's local spec builds `attention.py`'s subclass instead,
which runs causal attention per packed sequence (torch SDPA), so the same PackedSeqParams path
(including megatron's per-sequence THD RoPE, which restarts positions at every
cu_seqlens_padded boundary) works on both stacks.

Context parallel: `cp_zigzag_positions` gives the positions of the packed row this CP rank holds
(each padded sequence cut into 2*CP chunks; rank r holds chunks r and 2*CP-1-r, TE's THD split).
Local attention does not support CP (megatron asserts), so CP needs the TE spec.

Micro-batches: `balanced_partition` assigns samples to the fewest micro-batches whose padded
token count fits `max_tokens`, longest-first onto the least-loaded micro-batch (ties: lowest
index), so the assignment is deterministic and balanced; `plan_microbatches` also makes the
micro-batch count equal on every data-parallel rank (expert-parallel all-to-alls and pipeline
schedules need the same count everywhere), filling a rank's missing micro-batches with a dummy
all-padding sequence that carries no loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


def pad_multiple(tp: int = 1, cp: int = 1) -> int:
    """Every packed sequence is padded to this multiple: TP (SP split), and 2*CP*TP under CP."""
    return tp * 2 * cp if cp > 1 else tp


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple) if n > 0 else multiple


@dataclass(frozen=True)
class Segment:
    sample: int  # index into the caller's sample list; -1 for a dummy (all-padding) sequence
    row: int
    start: int  # first position in the row
    length: int  # real tokens
    padded: int  # real + padding positions owned by this segment


@dataclass
class MicroBatchLayout:
    """Where each sample's tokens sit in a [rows, width] micro-batch (see module docstring)."""

    packed: bool
    rows: int
    width: int
    segments: list[Segment]
    cp_size: int = 1
    cp_rank: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, lengths: Sequence[int], samples: Sequence[int] | None = None, *, packed: bool = True,
              multiple: int = 1, cp_size: int = 1, cp_rank: int = 0, width: int | None = None) -> "MicroBatchLayout":
        """Layout for samples of the given lengths (samples: their indices in the caller's list).

        packed: one row, each sequence padded to `multiple`. padded: one row per sample, all rows
        `width` wide (default: the longest length rounded up to `multiple`).
        """
        lengths = [int(n) for n in lengths]
        samples = list(range(len(lengths))) if samples is None else [int(s) for s in samples]
        if len(samples) != len(lengths):
            raise ValueError(f"{len(samples)} sample ids for {len(lengths)} lengths")
        if not lengths:
            raise ValueError("a micro-batch needs at least one sequence")
        if any(n < 1 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 1, got {lengths}")
        if cp_size > 1 and not packed:
            raise ValueError("context parallelism needs packed (THD) micro-batches")
        if cp_size > 1 and multiple % (2 * cp_size):
            raise ValueError(f"pad multiple {multiple} must be divisible by 2*cp={2 * cp_size}")
        if packed:
            segs, start = [], 0
            for s, n in zip(samples, lengths):
                p = round_up(n, multiple)
                segs.append(Segment(s, 0, start, n, p))
                start += p
            return cls(True, 1, start, segs, cp_size, cp_rank)
        w = round_up(max(lengths), multiple) if width is None else int(width)
        if w < max(lengths) or w % multiple:
            raise ValueError(f"width {w} must be >= {max(lengths)} and a multiple of {multiple}")
        segs = [Segment(s, r, 0, n, w) for r, (s, n) in enumerate(zip(samples, lengths))]
        return cls(False, len(segs), w, segs, cp_size, cp_rank)

    @classmethod
    def dummy(cls, multiple: int, packed: bool = True, cp_size: int = 1, cp_rank: int = 0) -> "MicroBatchLayout":
        """One all-padding sequence: keeps micro-batch counts equal across ranks; carries no loss."""
        layout = cls.build([multiple], [-1], packed=packed, multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)
        return layout

    def padded_to(self, width: int) -> "MicroBatchLayout":
        """The same packed layout with its last segment's padding extended so the row is `width`
        wide (a multiple of the layout's own width unit): fixed shapes for kernels that compile
        per shape. Real tokens, positions and loss rows are unchanged."""
        if not self.packed or width < self.width:
            raise ValueError(f"padded_to({width}): needs a packed layout no wider than that (width {self.width})")
        last = self.segments[-1]
        segs = self.segments[:-1] + [Segment(last.sample, last.row, last.start, last.length,
                                             last.padded + width - self.width)]
        return MicroBatchLayout(True, 1, width, segs, self.cp_size, self.cp_rank)

    # ------------------------------------------------------------------ basic facts
    @property
    def num_tokens(self) -> int:
        """Positions in the micro-batch (rows * width), padding included, before any CP split."""
        return self.rows * self.width

    @property
    def samples(self) -> list[int]:
        return [s.sample for s in self.segments]

    def cu_seqlens(self, padded: bool = False) -> Tensor:
        """int32 [n+1] cumulative (padded) sequence lengths of the packed row."""
        if not self.packed:
            raise ValueError("cu_seqlens exist for packed layouts only")
        key = ("cu", padded)
        if key not in self._cache:
            lens = [s.padded if padded else s.length for s in self.segments]
            self._cache[key] = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32)
        return self._cache[key]

    @property
    def max_seqlen(self) -> int:
        return max(s.padded for s in self.segments)

    def packed_seq_params(self, device=None):
        """megatron PackedSeqParams (qkv_format='thd') for this packed row; None when not packed.

        max_seqlen is the longest padded sequence (RoPE tables and TE kernels size by it)."""
        if not self.packed:
            return None
        cu = self.cu_seqlens(False).to(device) if device is not None else self.cu_seqlens(False)
        cup = self.cu_seqlens(True).to(device) if device is not None else self.cu_seqlens(True)
        return thd_packed_seq_params(cu, cup, self.max_seqlen)

    # ------------------------------------------------------------------ token placement
    def flat_positions(self) -> list[Tensor]:
        """For each segment, the flat indices (row * width + col) of its real tokens."""
        if "flat" not in self._cache:
            self._cache["flat"] = [
                s.row * self.width + s.start + torch.arange(s.length) for s in self.segments
            ]
        return self._cache["flat"]

    def scatter(self, per_sample: Sequence[Tensor | None], fill=0, dtype=None) -> Tensor:
        """Per-segment tensors [len_i, *extra] -> micro-batch tensor [rows, width, *extra].

        `per_sample[k]` belongs to segment k (None for a dummy segment: filled). `fill` is a
        scalar or a tensor broadcastable to [rows * width, *extra]."""
        if len(per_sample) != len(self.segments):
            raise ValueError(f"{len(per_sample)} tensors for {len(self.segments)} segments")
        ref = next((t for t in per_sample if t is not None), None)
        extra = tuple(ref.shape[1:]) if ref is not None else ()
        dtype = dtype or (ref.dtype if ref is not None else torch.long)
        out = torch.empty((self.rows * self.width, *extra), dtype=dtype)
        if isinstance(fill, Tensor):
            out.copy_(fill.expand_as(out))
        else:
            out.fill_(fill)
        for seg, t, pos in zip(self.segments, per_sample, self.flat_positions()):
            if t is None:
                continue
            if t.shape[0] != seg.length or tuple(t.shape[1:]) != extra:
                raise ValueError(
                    f"sample {seg.sample}: tensor of shape {tuple(t.shape)} for a sequence of "
                    f"{seg.length} tokens (expected [{seg.length}, {', '.join(map(str, extra))}])"
                )
            out[pos] = t.to(dtype)
        return out.view(self.rows, self.width, *extra)

    def gather(self, x: Tensor) -> list[Tensor]:
        """Micro-batch tensor [rows, width, *extra] -> per-segment tensors [len_i, *extra] (unpack)."""
        flat = x.reshape(self.rows * self.width, *x.shape[2:])
        return [flat[pos] for pos in self.flat_positions()]

    def position_ids(self) -> Tensor:
        """[rows, width] long: 0..padded_i-1 within every sequence (restarting per sequence)."""
        pos = torch.zeros(self.rows * self.width, dtype=torch.long)
        for s in self.segments:
            base = s.row * self.width + s.start
            n = s.padded if self.packed else self.width
            pos[base : base + n] = torch.arange(n)
        return pos.view(self.rows, self.width)

    def next_token_labels(self, ids: Sequence[Tensor | None]) -> Tensor:
        """[rows, width] long: at position start+t the token t+1 of the same sequence; 0 at each
        sequence's last token and at padding (those positions never enter a loss)."""
        shifted = [None if t is None else torch.cat([t[1:], t.new_zeros(1)]) for t in ids]
        return self.scatter(shifted, fill=0, dtype=torch.long)

    def prediction_index(self) -> tuple[Tensor, Tensor]:
        """Rows for the loss: (index [n, Lmax-1] long into the flat [rows*width] positions,
        valid [n, Lmax-1] bool). Column j of segment k is the position predicting token j+1."""
        if "pred" not in self._cache:
            n = len(self.segments)
            lmax = max(1, max(s.length for s in self.segments) - 1)
            idx = torch.zeros(n, lmax, dtype=torch.long)
            valid = torch.zeros(n, lmax, dtype=torch.bool)
            for k, s in enumerate(self.segments):
                m = s.length - 1
                if m > 0:
                    idx[k, :m] = s.row * self.width + s.start + torch.arange(m)
                    valid[k, :m] = s.sample >= 0
            self._cache["pred"] = (idx, valid)
        return self._cache["pred"]

    # ------------------------------------------------------------------ context parallel
    def local_positions(self) -> Tensor:
        """Flat positions this CP rank holds, in the order the model sees them."""
        if self.cp_size == 1:
            return torch.arange(self.num_tokens)
        return cp_zigzag_positions(self.cu_seqlens(True), self.cp_size, self.cp_rank)

    def to_local(self, x: Tensor) -> Tensor:
        """[rows, width, *extra] -> this CP rank's [rows, width / cp, *extra] (identity for cp=1)."""
        if self.cp_size == 1:
            return x
        flat = x.reshape(self.rows * self.width, *x.shape[2:])
        return flat[self.local_positions()].view(1, -1, *x.shape[2:])

    def full_to_local(self) -> Tensor:
        """long [rows*width]: local index of each flat position, -1 where another CP rank holds it."""
        if "f2l" not in self._cache:
            m = torch.full((self.num_tokens,), -1, dtype=torch.long)
            loc = self.local_positions()
            m[loc] = torch.arange(loc.numel())
            self._cache["f2l"] = m
        return self._cache["f2l"]


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def cp_zigzag_positions(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Packed-row positions held by `cp_rank`: every padded sequence is cut into 2*cp equal chunks;
    rank r gets chunks r and 2*cp-1-r of every sequence, sequence by sequence (TE's THD split)."""
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        if n % (2 * cp_size):
            raise ValueError(f"padded sequence length {n} is not divisible by 2*cp={2 * cp_size}")
        c = n // (2 * cp_size)
        parts.append(torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c))
        parts.append(torch.arange(a + (2 * cp_size - 1 - cp_rank) * c, a + (2 * cp_size - cp_rank) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def sp_slice(num_local_tokens: int, tp_size: int, tp_rank: int) -> slice:
    """Sequence-parallel slice of the (CP-local) sequence dimension that TP rank `tp_rank` owns."""
    if num_local_tokens % tp_size:
        raise ValueError(f"{num_local_tokens} tokens are not divisible by tp={tp_size} (sequence parallel)")
    n = num_local_tokens // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


# ---------------------------------------------------------------------------- micro-batches
def balanced_partition(costs: Sequence[int], max_cost: int, min_parts: int = 1) -> list[list[int]]:
    """Indices of `costs` split into the fewest parts (>= min_parts) whose sums fit `max_cost`.

    Longest-first onto the least-loaded part that fits (ties: lowest part index); indices inside
    a part are ascending. Deterministic. Raises when one cost exceeds `max_cost`.
    """
    costs = [int(c) for c in costs]
    if max_cost < 1:
        raise ValueError(f"max_cost must be >= 1, got {max_cost}")
    too_big = [i for i, c in enumerate(costs) if c > max_cost]
    if too_big:
        raise ValueError(
            f"sequence {too_big[0]} needs {costs[too_big[0]]} tokens (padded) but "
            f"train.max_tokens_per_microbatch={max_cost}: raise the budget to at least {max(costs)}"
        )
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    k = max(min_parts, math.ceil(sum(costs) / max_cost) if costs else 1, 1)
    while True:
        loads = [0] * k
        parts: list[list[int]] = [[] for _ in range(k)]
        ok = True
        for i in order:
            best = None
            for j in range(k):
                if loads[j] + costs[i] <= max_cost and (best is None or loads[j] < loads[best]):
                    best = j
            if best is None:
                ok = False
                break
            loads[best] += costs[i]
            parts[best].append(i)
        if ok:
            return [sorted(p) for p in parts]
        k += 1


def fixed_partition(n: int, size: int, min_parts: int = 1) -> list[list[int]]:
    """Consecutive groups of `size` samples (the classic micro_batch_size split), >= min_parts."""
    parts = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    while len(parts) < min_parts:
        parts.append([])
    return parts


def _dp_max(value: int, group) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    from .forward import device

    t = torch.tensor([value, -value], dtype=torch.long, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])


def plan_microbatches(lengths: Sequence[int], *, packed: bool = True, max_tokens: int | None = None,
                      micro_batch_size: int = 1, tp: int = 1, cp: int = 1, cp_rank: int = 0,
                      dp_group=None, pad_to: int | None = None) -> list[MicroBatchLayout]:
    """This rank's micro-batch layouts for samples of `lengths` (indices refer to that list).

    packed + max_tokens: balanced token-budget micro-batches (dynamic batch size).
    otherwise: consecutive groups of `micro_batch_size` samples (packed into one row, or padded).
    The count is made equal over `dp_group` (all-reduce max); empty slots get a dummy sequence.
    packed + pad_to: every row's width rounded up to a multiple of pad_to (itself rounded up to
    the TP / CP multiple), so kernels that compile per shape (Triton) see few shapes.
    """
    multiple = pad_multiple(tp, cp)
    n = len(lengths)
    if packed and max_tokens:
        padded = [round_up(int(x), multiple) for x in lengths]
        parts = balanced_partition(padded, max_tokens)
        k = _dp_max(len(parts), dp_group)
        while True:  # agree on one count; every rank takes the same branches (collectives inside)
            if len(parts) != k:
                parts = balanced_partition(padded, max_tokens, min_parts=k)
            k_all = _dp_max(len(parts), dp_group)
            if k_all == k:
                break
            k = k_all
    else:
        k = _dp_max(max(1, math.ceil(n / micro_batch_size)), dp_group)
        parts = fixed_partition(n, micro_batch_size, min_parts=k)
    layouts = []
    for part in parts:
        if not part:
            layouts.append(MicroBatchLayout.dummy(multiple, packed=packed, cp_size=cp, cp_rank=cp_rank))
        else:
            layouts.append(MicroBatchLayout.build([lengths[i] for i in part], part, packed=packed,
                                                  multiple=multiple, cp_size=cp, cp_rank=cp_rank))
    if packed and pad_to:
        unit = round_up(int(pad_to), multiple)
        layouts = [m.padded_to(round_up(m.width, unit)) for m in layouts]
    return layouts


def mini_batches(batch, count: int) -> list:
    """The global batch cut into `count` mini-batches of whole samples, in order (sizes differ by
    at most one): GRPO's groups stay together when their size divides the mini-batch size."""
    n = len(batch)
    if not 1 <= count <= n:
        raise ValueError(f"{count} mini-batches of a batch of {n} samples")
    bounds = [i * n // count for i in range(count + 1)]
    return [batch.select(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def shard_for_dp(lengths: Sequence[int], dp_size: int, dp_rank: int) -> list[int]:
    """Indices of the global batch this DP rank trains on: balanced by tokens, deterministic
    (same longest-first rule as the micro-batches, with no budget)."""
    if dp_size == 1:
        return list(range(len(lengths)))
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    loads, counts, owner = [0] * dp_size, [0] * dp_size, {}
    for i in order:
        j = min(range(dp_size), key=lambda r: (counts[r], loads[r], r))
        owner[i] = j
        loads[j] += int(lengths[i])
        counts[j] += 1
    return [i for i in range(len(lengths)) if owner[i] == dp_rank]


def thd_packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen: int, total_tokens: int | None = None):
    """megatron PackedSeqParams (qkv_format='thd') for one packed row: real and padded sequence
    starts (int32, batch + 1), the longest padded sequence, and the row's length (cu_seqlens_padded[-1];
    pass it when cu is on the GPU, where reading it would sync the device)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    extra = {}
    if "total_tokens" in PackedSeqParams.__dataclass_fields__:
        # megatron-core 0.19: the Mamba layers read seq_idx from here, and it is built only
        # from total_tokens; without it their state would run across the packed sequences
        extra["total_tokens"] = int(cu_seqlens_padded[-1]) if total_tokens is None else int(total_tokens)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, **extra,
    )
