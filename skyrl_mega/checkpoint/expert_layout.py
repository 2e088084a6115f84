"""How an HF checkpoint stores its routed experts: one 2-D tensor per expert, or fused 3-D.

The bridges name experts one per expert (`...mlp.experts.E.{gate,up,down}_proj.weight`). The
released Qwen3.5-MoE checkpoints store each decoder layer's routed experts fused, without a
`.weight` suffix (their MTP layer keeps per-expert tensors):

    <layer>.mlp.experts.gate_up_proj   [experts, 2 x ffn, hidden]   gate rows, then up rows
    <layer>.mlp.experts.down_proj      [experts, hidden, ffn]

so expert E's gate_proj is gate_up_proj[E, :ffn], its up_proj gate_up_proj[E, ffn:], its
down_proj down_proj[E]: slices, no transpose. This module is the one place that knows that.

In:  a checkpoint's stored tensor names and shapes (safetensors headers).
Out: `ExpertLayout`:
       .name                 "fused" or "per-expert" (what `validate` reports)
       .parts                per-expert name -> Part(stored name, expert, row slice)
       .view(names)          the stored names as the bridges see them (fused ones -> parts)
       .fuse(named tensors)  a stream of per-expert tensors -> the stored layout again: each
                             fused tensor is yielded once all of its parts have passed (then
                             dropped from memory), every other tensor as it comes; a fused
                             tensor left incomplete at the end is an error.
     `read_part(safe_open handle, part)`: one expert's slice of a fused tensor, read alone;
     `fused_shapes(per-expert shapes)`: the fused tensors that would hold them (make-tiny
     writes the released layout with ExpertLayout(fused_shapes(...)).fuse(...)).
Writing an HF checkpoint in its source's layout keeps it byte for byte where weights did not
change: the parts are exact slices, and fusing concatenates them back in the same order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

FUSED = "fused"
PER_EXPERT = "per-expert"
_PER_EXPERT_NAME = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")
_FUSED_NAME = re.compile(r"^(?P<base>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Part:
    stored: str                   # the fused tensor's name
    expert: int
    rows: Optional[slice] = None  # gate / up rows of gate_up_proj; None: the whole expert slice


def _parts_of(name: str, shape: list[int]) -> dict[str, Part]:
    """The per-expert names and slices one fused tensor holds ({} when the name is not fused)."""
    m = _FUSED_NAME.match(name)
    if m is None or len(shape) != 3:
        return {}
    base, experts = m.group("base"), shape[0]
    if m.group("kind") == "down_proj":
        return {f"{base}.{e}.down_proj.weight": Part(name, e) for e in range(experts)}
    if shape[1] % 2:
        raise ValueError(f"{name}: fused gate_up_proj of shape {shape} has an odd row count")
    ffn = shape[1] // 2
    out = {}
    for e in range(experts):
        out[f"{base}.{e}.gate_proj.weight"] = Part(name, e, slice(0, ffn))
        out[f"{base}.{e}.up_proj.weight"] = Part(name, e, slice(ffn, 2 * ffn))
    return out


class ExpertLayout:
    """The expert layout of one checkpoint, from its stored names and shapes."""

    def __init__(self, shapes: dict[str, list[int]]):
        self.parts: dict[str, Part] = {}
        self.members: dict[str, list[str]] = {}  # fused name -> its per-expert names, in order
        for name, shape in shapes.items():
            parts = _parts_of(name, list(shape))
            if parts:
                self.parts.update(parts)
                self.members[name] = list(parts)
        self.name = FUSED if self.members else PER_EXPERT

    def view(self, stored: Iterable[str]) -> list[str]:
        """Stored names as the bridges read them: each fused tensor replaced by its parts."""
        out = []
        for n in stored:
            out.extend(self.members.get(n, [n]))
        return out

    def fuse(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors back into the fused tensors this layout stores (see module doc)."""
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            part = self.parts.get(name)
            if part is None:
                yield name, tensor
                continue
            got = waiting.setdefault(part.stored, {})
            got[name] = tensor
            if len(got) == len(self.members[part.stored]):
                yield part.stored, self._assemble(part.stored, waiting.pop(part.stored))
        if waiting:
            stored = sorted(waiting)
            missing = len(self.members[stored[0]]) - len(waiting[stored[0]])
            raise ValueError(f"fusing experts: {len(stored)} fused tensors incomplete ({stored[0]}: "
                             f"{missing} of its {len(self.members[stored[0]])} parts never came)")

    def _assemble(self, stored: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        names = self.members[stored]
        if self.parts[names[0]].rows is None:  # down_proj: one slice an expert
            return torch.stack([got[n] for n in names])
        per_expert = [torch.cat([got[g], got[u]]) for g, u in zip(names[0::2], names[1::2])]
        return torch.stack(per_expert)


def fused_shapes(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per-expert tensors' shapes -> the shapes of the fused tensors holding them, one
    gate_up_proj and one down_proj per `...experts` group (experts numbered 0..E-1)."""
    groups: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        m = _PER_EXPERT_NAME.match(name)
        if m:
            groups.setdefault(m.group("base"), {})[f"{m.group('kind')}{m.group('e')}"] = list(shape)
    out = {}
    for base, got in groups.items():
        experts = len(got) // 3
        ffn, hidden = got["gate0"]
        if sorted(got) != sorted(f"{k}{e}" for k in ("gate", "up", "down") for e in range(experts)):
            raise ValueError(f"{base}: per-expert tensors are not gate/up/down for experts 0..{experts - 1}")
        out[f"{base}.gate_up_proj"] = [experts, 2 * ffn, hidden]
        out[f"{base}.down_proj"] = [experts, hidden, ffn]
    return out


def read_part(handle, part: Part) -> torch.Tensor:
    """Expert `part.expert`'s slice of a fused tensor from an open safetensors file (only those
    bytes are read), as a tensor of its own."""
    piece = handle.get_slice(part.stored)
    t = piece[part.expert] if part.rows is None else piece[part.expert, part.rows]
    return t.contiguous().clone() if t.dim() and t.untyped_storage().nbytes() != t.nbytes else t
