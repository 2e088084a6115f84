"""The bucket plan's types and its wire form: which HF tensor sits where in which bucket.

In: nothing at run time (plain data, built by planner.py once per model shape and checked by
plan_check.py on every sync). Out: a BucketPlan that the exporter (export.py) fills and the
transports send; receivers get its JSON (`plan.wire()`, read back with `plan_from_wire`).

Buckets
- dense buckets: non-expert HF tensors of one pipeline stage, filled in parameter order up to
  `bucket_bytes`; tensors start at 512-byte aligned offsets after a 512-byte header.
- expert buckets: ALL experts of one MoE layer (every expert tensor of that layer) in one
  dedicated bucket, whatever its size, so the EP (x ETP) gather of that layer is one
  collective. With ETP=1 the bucket IS the gather output: rank r's local experts sit at
  [header + r * local_bytes, ...), and every HF tensor (gate_proj / up_proj / down_proj of
  one expert) is a contiguous byte range in it, so nothing is repacked ("in-place" layout).
  Otherwise the gathered shards are merged and copied into an aligned HF-ordered layout
  ("staged" layout).
`direct` marks a tensor that is a contiguous view of one of the SENDER's own parameters (no
gather or conversion copy needed): the CUDA IPC transport hands those out without packing
them (`ipc_offset = -1`); its other tensors get a compact `ipc_offset`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

HEADER_BYTES = 512
ALIGN = 512
DEFAULT_BUCKET_BYTES = 1 << 30
BUCKET_ORDERS = ("experts", "dense")  # which kind of bucket goes first in each stage (planner.build_plan)

LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
EXPERT_PARAM = re.compile(r"^(.*\.mlp\.experts\.(linear_fc[12])\.weight)(\d+)$")  # Megatron's per-expert names


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).split(".")[-1]


def to_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def global_expert_name(global_name: str, ep_rank: int, per_rank: int) -> str:
    """`...linear_fcK.weight{local id}` of EP rank `ep_rank` -> the name of that global expert."""
    prefix, local_id = EXPERT_PARAM.match(global_name).group(1, 3)
    return f"{prefix}{ep_rank * per_rank + int(local_id)}"


@dataclass(frozen=True)
class TensorSlot:
    """One HF tensor inside a bucket: byte range [offset, offset + nbytes) of the bucket."""

    index: int  # position in the whole plan (row of the checksum table)
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    direct: bool = False
    ipc_offset: int = -1

    def view(self, buf: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        o = self.offset if offset is None else offset
        return buf[o : o + self.nbytes].view(to_dtype(self.dtype)).view(self.shape)


@dataclass
class DenseUnit:
    """One Megatron parameter of a dense bucket (sender side)."""

    stage: int
    vpp: int
    local_name: str
    global_name: str
    local_shape: tuple[int, ...]
    dtype: str
    tp_sharded: bool
    partition_dim: int
    slots: list[tuple[int, int]] = field(default_factory=list)  # (HF output position, index into bucket.tensors)


@dataclass
class ExpertParam:
    local_name: str
    global_name: str  # ...linear_fcK.weight{local expert id}
    local_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int  # byte offset inside this rank's flattened local experts


@dataclass
class ExpertGroup:
    """All experts of one MoE layer (sender side)."""

    stage: int
    vpp: int
    layer: int
    params: list[ExpertParam]
    local_bytes: int
    in_place: bool
    # slot indices per (member, param): slots[m][p] -> indices into bucket.tensors
    slots: list[list[list[int]]] = field(default_factory=list)


@dataclass
class BucketSpec:
    index: int
    kind: str  # "dense" | "experts"
    stage: int
    nbytes: int
    tensors: list[TensorSlot] = field(default_factory=list)
    units: list[DenseUnit] = field(default_factory=list)
    experts: ExpertGroup | None = None
    ipc_nbytes: int = 0

    def wire(self) -> dict:
        return {"nbytes": self.nbytes, "kind": self.kind,
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]}


@dataclass
class BucketPlan:
    buckets: list[BucketSpec]
    bucket_bytes: int
    leaders: list[int]  # global rank that assembles each pipeline stage's buckets
    ep_members: list[tuple[int, int]]  # (ep_rank, etp_rank) of each member of this rank's expert gather group
    plan_id: str = ""
    first: str = "experts"  # which kind of bucket goes first in each stage (see planner.build_plan)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b.tensors)

    @property
    def max_bucket_nbytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    def wire(self) -> dict:
        """What receivers need: per bucket, its size and its tensors (name, dtype, shape, offset, nbytes)."""
        w = getattr(self, "_wire", None)
        if w is None or w.get("plan_id") != self.plan_id:
            w = {"plan_id": self.plan_id, "num_tensors": self.num_tensors,
                 "buckets": [b.wire() for b in self.buckets]}
            self._wire = w
        return w

    def summary(self) -> dict:
        return {"plan_id": self.plan_id, "buckets": len(self.buckets), "tensors": self.num_tensors,
                "bytes": self.total_bytes, "max_bucket_bytes": self.max_bucket_nbytes,
                "expert_buckets": sum(b.kind == "experts" for b in self.buckets),
                "bucket_bytes": [b.nbytes for b in self.buckets]}


def wire_slots(wire_bucket: dict, first_index: int = 0) -> list[TensorSlot]:
    """TensorSlots from a bucket's wire form (receiver side)."""
    return [TensorSlot(first_index + i, n, d, tuple(s), o, nb)
            for i, (n, d, s, o, nb) in enumerate(wire_bucket["tensors"])]


def plan_from_wire(wire: dict[str, Any]) -> tuple[str, list[list[TensorSlot]]]:
    """(plan_id, per bucket its TensorSlots) from the JSON a receiver got."""
    out, first = [], 0
    for b in wire["buckets"]:
        slots = wire_slots(b, first)
        out.append(slots)
        first += len(slots)
    return wire["plan_id"], out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (callers run under no_grad)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8)


def direct_view(param: torch.Tensor, t: TensorSlot, intra: int) -> torch.Tensor:
    """The HF tensor `t` of a direct slot: bytes [intra, intra + nbytes) of the sender's parameter."""
    return flat_bytes(param)[intra: intra + t.nbytes].view(to_dtype(t.dtype)).view(t.shape)


class DirectRefs(list):
    """One bucket's direct tensors as the exporter yields them: (parameter, [(TensorSlot, byte
    offset in the parameter), ...]) pairs. `key` is set (never reused) when the list is the
    exporter's cached one: the same tensors at the same addresses as the last time that key was
    yielded, so a transport may reuse what it derived from them without touching each tensor
    again (the exporter's sweep aborts the sync before its commit if one of them moved)."""

    key = None


def bucket_tensors(b: BucketSpec, buf: torch.Tensor | None, direct, layout: str = "full"):
    """(name, tensor) of one exported bucket: views into `buf` plus the direct tensors."""
    out = [(t.name, direct_view(p, t, intra)) for p, slots in direct for t, intra in slots]
    if buf is not None:
        for t in b.tensors:
            if layout == "ipc" and t.direct:
                continue
            out.append((t.name, t.view(buf, t.offset if layout == "full" else t.ipc_offset)))
    return out
