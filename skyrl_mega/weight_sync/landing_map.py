"""Where each sent tensor lands in a vLLM model's parameters, learned once from vLLM's own loaders.

In: the live vLLM model (after a full load through vLLM's layer-wise reload) and the
(name, dtype, shape) of every tensor the trainer sends. Out: a LandingMap, name -> (parameter,
first element), when every tensor lands as ONE contiguous copy of its bytes into one parameter
and the tensors cover every parameter exactly once; otherwise the reason it does not apply
(the engine then keeps loading through vLLM's reload path).

Learning (`learn`) calls `model.load_weights` once per name on a scratch tensor under a
TorchDispatchMode that records, and does not run, every copy into a parameter or buffer and
every constant fill (vocab padding rows: the same value on every load, so later syncs leave
them be): the model is left as it was. Any other write into a parameter (an index_put, an
in-place op) means the loader does more than place bytes, and the map is refused.
`verify` then checks the map against what the reference load left in the parameters: each
landed region's checksum equals the sender's. `copy_plan` turns the map and one update's tensor
table ((name, dtype, shape, source buffer, byte offset)) into merged copies (copy_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .checksum import tensor_checksum
from .copy_plan import CopyPlan
from .plan import to_dtype


class _Refused(Exception):
    pass


@dataclass
class LandingMap:
    """name -> (parameter name, first element); `skipped`: names the model's loader ignores."""

    where: dict[str, tuple[str, int]]
    skipped: set[str]
    flat: dict[str, torch.Tensor]  # parameter name -> 1-D view of its storage
    ptrs: tuple = field(default_factory=tuple)  # the parameters' addresses when learned
    fills: list = field(default_factory=list)  # (parameter, first element, numel, value): constants
    slots: tuple = field(default_factory=tuple)  # (module, name, parameter, address) when learned

    def fresh(self, model: torch.nn.Module) -> bool:
        """Still valid: the model's parameters sit where they sat when the map was learned.
        With `slots`: each learned parameter is still registered on its module under its name,
        at the same address (what a reload or a re-allocation changes), checked without walking
        the module tree (~1 ms for a 48-layer model, on the first round's path); a submodule
        replaced as a whole is not seen (vLLM replaces parameters, not modules)."""
        if self.slots:
            return all(m._parameters.get(n) is p and p.data_ptr() == ptr for m, n, p, ptr in self.slots)
        return self.ptrs == _param_ptrs(model)

    def region(self, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        pname, start = self.where[name]
        n = _numel(shape)
        return self.flat[pname][start: start + n].view(shape)

    def covers(self, names) -> bool:
        return all(n in self.where or n in self.skipped for n in names)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _param_ptrs(model: torch.nn.Module) -> tuple:
    return tuple((n, p.data_ptr(), p.numel()) for n, p in model.named_parameters())


def _param_slots(model: torch.nn.Module) -> tuple:
    return tuple((m, n, p, p.data_ptr()) for m in model.modules() for n, p in m._parameters.items() if p is not None)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n not in out})
    return out


_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


class _Recorder(TorchDispatchMode):
    """Records copies whose destination is a model tensor (and skips them); refuses other writes."""

    def __init__(self, storages: dict[int, list[tuple[str, torch.Tensor]]]):
        super().__init__()
        self.storages = storages
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple[torch.Tensor, float]] = []  # constants (vocab padding): same every load

    def _owner(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return False
        try:
            return t.untyped_storage().data_ptr() in self.storages
        except (RuntimeError, NotImplementedError):
            return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and self._owner(args[0]):
            self.copies.append((args[0], args[1]))
            return args[0]
        if func in _FILLS and self._owner(args[0]):
            if args[0].numel():
                self.fills.append((args[0], float(args[1]) if len(args) > 1 else 0.0))
            return args[0]
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                if self._owner(t):
                    raise _Refused(f"the loader writes a parameter with {func} (not a plain copy or a fill)")
        return func(*args, **kwargs)


def _locate(storages, dst: torch.Tensor) -> tuple[str, int]:
    for pname, p in storages[dst.untyped_storage().data_ptr()]:
        if not p.is_contiguous() or p.dtype != dst.dtype:
            continue
        start = (dst.data_ptr() - p.data_ptr()) // p.element_size()
        if 0 <= start and start + dst.numel() <= p.numel():
            return pname, start
    raise _Refused("a copy lands outside every contiguous parameter of its dtype")


def learn(model: torch.nn.Module, tensors: list[tuple[str, str, list]], device) -> LandingMap | str:
    """The landing map of `tensors` [(name, dtype, shape)] in `model`, or why there is none."""
    named = _tensors(model)
    storages: dict[int, list] = {}
    for pname, p in named.items():
        if p.device.type != "meta":
            storages.setdefault(p.untyped_storage().data_ptr(), []).append((pname, p))
    biggest = max((_numel(s) * to_dtype(d).itemsize for _, d, s in tensors), default=0)
    scratch = torch.empty(biggest, dtype=torch.uint8, device=device)
    where: dict[str, tuple[str, int]] = {}
    skipped: set[str] = set()
    fills: list[tuple[str, int, int, float]] = []
    try:
        for name, dt, shape in tensors:
            dtype = to_dtype(dt)
            src = scratch[: _numel(shape) * dtype.itemsize].view(dtype).view(shape)
            rec = _Recorder(storages)
            with torch.no_grad(), rec:
                model.load_weights(weights=[(name, src)])
            for dst, value in rec.fills:
                if not dst.is_contiguous():
                    raise _Refused(f"{name}: the loader fills a strided region")
                pname, start = _locate(storages, dst)
                fills.append((pname, start, dst.numel(), value))
            if not rec.copies:
                skipped.add(name)
                continue
            if len(rec.copies) != 1:
                raise _Refused(f"{name} lands in {len(rec.copies)} places")
            dst, s = rec.copies[0]
            if not (dst.is_contiguous() and s.is_contiguous() and s.data_ptr() == src.data_ptr()
                    and s.numel() == src.numel() and s.dtype == dtype == dst.dtype):
                raise _Refused(f"{name} is not copied byte for byte (a slice, a transpose or a cast)")
            where[name] = _locate(storages, dst)
    except _Refused as e:
        return str(e)
    except Exception as e:  # the loader failed on a scratch tensor: keep vLLM's own path
        return f"learning failed: {type(e).__name__}: {e}"
    finally:
        del scratch
    # every parameter exactly covered: nothing the loader derives elsewhere is left stale
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, dt, shape in tensors:
        if name in where:
            pname, start = where[name]
            spans.setdefault(pname, []).append((start, _numel(shape)))
    for pname, start, n, _ in set(fills):
        spans.setdefault(pname, []).append((start, n))
    for pname, p in model.named_parameters():
        pos = 0
        for start, n in sorted(spans.get(pname, [])):
            if start != pos:
                return f"parameter {pname} is not covered exactly by the sent tensors (gap or overlap at {pos})"
            pos += n
        if pos != p.numel():
            return f"parameter {pname} is not loaded from the sent tensors ({pos} of {p.numel()} elements)"
    flat = {pname: named[pname].detach().view(-1) for pname in spans}
    return LandingMap(where, skipped, flat, _param_ptrs(model), sorted(set(fills)), _param_slots(model))


def verify(lmap: LandingMap, tensors: list[tuple[str, str, list]], sums: dict[str, torch.Tensor]) -> str | None:
    """None when every mapped region holds the bytes the sender checksummed (and every filled
    region its constant), else the first mismatch."""
    for pname, start, n, value in lmap.fills:
        region = lmap.flat[pname][start: start + n]
        if not bool((region == value).all()):
            return f"{pname}: the region the loader fills with {value} holds other values"
    for name, dt, shape in tensors:
        if name in lmap.skipped:
            continue
        got = tensor_checksum(lmap.region(name, to_dtype(dt), shape))
        if name not in sums or not torch.equal(got.cpu(), sums[name].cpu()):
            return f"{name}: the reference load left other bytes than the map says"
    return None


def copy_plan(lmap: LandingMap, entries: list[list]) -> tuple[CopyPlan, list[int]]:
    """Copies for one update's tensor table [name, dtype, shape, source key, byte offset, nbytes, ...]
    -> (the plan, the table rows it copies, in slot order)."""
    plan, rows = CopyPlan(), []
    for i, (name, dt, shape, key, off, nbytes, *_) in enumerate(entries):
        if name in lmap.skipped:
            continue
        pname, start = lmap.where[name]
        dtype = to_dtype(dt)
        plan.add(key, int(off), dtype, lmap.flat[pname], start, _numel(shape), len(rows))
        rows.append(i)
    return plan, rows
