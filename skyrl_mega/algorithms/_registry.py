"""Name -> function registries shared by the algorithm modules.

In: a human-readable kind ("advantage estimator", "policy loss", ...).
Out: ``(registry_dict, register(name), get(name))``. ``register`` is a decorator
factory; ``get`` raises ``ValueError`` naming the available choices.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def make_registry(kind: str) -> tuple[dict[str, Callable], Callable, Callable]:
    registry: dict[str, Callable] = {}

    def register(name: str, *, override: bool = False) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if not callable(fn):
                raise TypeError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
            if name in registry and registry[name] is not fn and not override:
                raise ValueError(
                    f"{kind} {name!r} is already registered; pass override=True to replace it"
                )
            registry[name] = fn
            return fn

        return decorator

    def get(name: str) -> Callable:
        try:
            return registry[name]
        except (KeyError, TypeError):
            choices = ", ".join(sorted(registry)) or "(none registered)"
            raise ValueError(f"unknown {kind} {name!r}; choices: {choices}") from None

    register.__doc__ = (
        f"Decorator: register a {kind} under ``name`` (``override=True`` to replace one)."
    )
    get.__doc__ = f"Return the {kind} registered under ``name``; ValueError listing choices if unknown."
    return registry, register, get
