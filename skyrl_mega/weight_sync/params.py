"""Where every exported tensor of this rank lives, read again by name on every sync.

In: the Megatron model chunks of this rank. Out: `local_params` (vpp, local name, tensor) in
the one fixed order the plan is built in (planner.py), and a ParamIndex that re-reads those
tensors from their owning modules (the per-sync check, plan_check.py, and the exporter's
lookups go through it). The index caches no tensor: a parameter whose tensor was replaced
(`p.data = ...`, a new nn.Parameter) is seen by the next lookup.
"""

from __future__ import annotations

from operator import attrgetter

import torch


def unwrap(models) -> list[torch.nn.Module]:
    from mbridge.core.util import unwrap_model

    return [unwrap_model(m) for m in models]


def local_params_of(vpp, m):
    """(name, tensor) of every exported tensor of one model chunk: its parameters plus the
    router's expert_bias (a buffer that megatron keeps out of named_parameters), exactly as
    mbridge's export enumerates them."""
    seen = set()
    for name, p in m.named_parameters():
        seen.add(name)
        yield name, p
    for name, b in m.named_buffers():
        if "expert_bias" in name and name not in seen and "_extra_state" not in name:
            yield name, b


def local_params(models) -> list[tuple[int, str, torch.Tensor]]:
    """(vpp, local name, tensor) of every exported tensor of this rank, in a fixed order."""
    return [(vpp, name, t) for vpp, m in enumerate(unwrap(models)) for name, t in local_params_of(vpp, m)]


class ParamIndex:
    """Where every exported tensor lives: `keys[i]` = (vpp, name), owned by module `_mods[i]`
    under attribute `_attrs[i]` of its `_parameters` or `_buffers` dict.

    Built with one full module traversal; afterwards `get(i)` / `lookup()` re-read tensors by
    name from their owners, so a parameter whose tensor was replaced (`p.data = ...`, a new
    nn.Parameter) is seen on the next sync without walking the module tree again. `lookup()`
    and `shapes()` run as C-level maps (0.1 ms for 1139 tensors on a warm CPU)."""

    def __init__(self, models):
        self.keys: list[tuple[int, str]] = []
        self._mods, self._kinds, self._attrs = [], [], []
        for vpp, m in enumerate(unwrap(models)):
            mods = dict(m.named_modules())
            for name, _t in local_params_of(vpp, m):
                owner, _, attr = name.rpartition(".")
                mod = mods[owner] if owner else m
                self.keys.append((vpp, name))
                self._mods.append(mod)
                self._kinds.append("_parameters" if attr in mod._parameters else "_buffers")
                self._attrs.append(attr)
        self.pos = {k: i for i, k in enumerate(self.keys)}

    def lookup(self) -> list[torch.Tensor]:
        """Every tensor, in `keys` order, read again from its owner; KeyError if one is gone."""
        ts = chunked_map(dict.get, chunked_map(getattr, self._mods, self._kinds), self._attrs)
        for i, t in enumerate(ts):
            if t is None:
                raise KeyError(self.keys[i][1])
        return ts

    def get(self, i: int) -> torch.Tensor | None:
        """Tensor `i`, read from its owner now (None if it is gone)."""
        return getattr(self._mods[i], self._kinds[i]).get(self._attrs[i])

    @staticmethod
    def shapes(ts: list[torch.Tensor]) -> list[tuple]:
        """(shape, dtype) of each tensor: with `keys`, this rank's plan signature."""
        return chunked_map(_SHAPE_DTYPE, ts)


_SHAPE_DTYPE = attrgetter("shape", "dtype")

# A C-level map holds the GIL from its first item to its last: over thousands of tensors that
# touch cold memory (about a microsecond each) it would keep the weight sync's poster thread
# from sending a round for milliseconds. Chunks of this many items let it in between.
MAP_CHUNK = 256


def chunked_map(fn, *seqs) -> list:
    """list(map(fn, *seqs)) in chunks of MAP_CHUNK, so other threads get the GIL in between."""
    n = min(map(len, seqs))
    if n <= MAP_CHUNK:
        return list(map(fn, *seqs))
    out: list = []
    for i in range(0, n, MAP_CHUNK):
        out.extend(map(fn, *(s[i: i + MAP_CHUNK] for s in seqs)))
    return out
