"""What the local and TE specs share: reading megatron's spec entries, and the R3 router entry.

In:  megatron-core layer specs. A slot holds a class, a ModuleSpec (0.16.1) or, for the MLP /
     MoE slots of 0.19, a functools.partial(module, submodules=...).
Out: `module_of` / `submodules_of` for any of those forms; `use_r3_router(block)` puts
     `R3TopKRouter` in the router slot (MoESubmodules.router, 0.16.1 and 0.19) of every MoE layer;
     `swap_modules(spec, {old: new})` replaces module classes anywhere in a spec tree.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from ..r3_replay import R3RouterReplay


def module_of(entry):
    """The module class a spec entry builds (None for None)."""
    if isinstance(entry, ModuleSpec):
        return entry.module
    if isinstance(entry, functools.partial):
        return entry.func
    return entry


def submodules_of(entry):
    """The submodules dataclass of a spec entry, or None."""
    if isinstance(entry, ModuleSpec):
        return entry.submodules
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return None


class R3TopKRouter(TopKRouter):
    """megatron's TopKRouter holding its model's own R3RouterReplay (r3_replay.py) instead of a
    RouterReplay in megatron's process-global list. Built with megatron's
    moe_enable_routing_replay off (the bridge keeps it off), so megatron creates none itself."""

    def __init__(self, config, *args, **kwargs):
        if config.moe_enable_routing_replay:
            raise ValueError("R3TopKRouter keeps its own replay state: build it with megatron's "
                             "moe_enable_routing_replay=False (ModelBridge does)")
        super().__init__(config, *args, **kwargs)
        self.router_replay = R3RouterReplay()


def use_r3_router(block) -> int:
    """Sets R3TopKRouter as the router of every MoE layer spec in `block` (a decoder block spec,
    or a list of layer specs); returns how many."""
    count = 0
    for layer in getattr(block, "layer_specs", block):
        mlp = getattr(submodules_of(layer), "mlp", None)
        module, moe = module_of(mlp), submodules_of(mlp)
        if isinstance(module, type) and issubclass(module, MoELayer) and moe is not None:
            moe.router = R3TopKRouter
            count += 1
    return count


def _swapped(entry, mapping: dict, count: list):
    """`entry` with its own class and every class below it replaced per `mapping`."""
    if isinstance(entry, type):
        if entry in mapping:
            count[0] += 1
            return mapping[entry]
        return entry
    if isinstance(entry, (list, tuple)):
        return type(entry)(_swapped(e, mapping, count) for e in entry)
    if isinstance(entry, ModuleSpec):
        entry.module = _swapped(entry.module, mapping, count)
        entry.submodules = _swapped(entry.submodules, mapping, count)
        return entry
    if isinstance(entry, functools.partial):
        keywords = {k: _swapped(v, mapping, count) for k, v in entry.keywords.items()}
        return functools.partial(_swapped(entry.func, mapping, count), *entry.args, **keywords)
    if dataclasses.is_dataclass(entry) and not isinstance(entry, type):
        for f in dataclasses.fields(entry):
            setattr(entry, f.name, _swapped(getattr(entry, f.name), mapping, count))
    return entry


def swap_modules(spec, mapping: dict) -> tuple[object, int]:
    """(`spec` with each class in `mapping` replaced by its value, how many slots changed); a
    ModuleSpec or dataclass is edited in place, a partial is rebuilt."""
    count = [0]
    return _swapped(spec, mapping, count), count[0]
