"""Version guards and the per-process record of applied shims, shared by the compat modules.

In:  a `Shim` record: the dependency it fixes, the version range where it is needed (a PEP 440
     specifier, set from reading that dependency's source) and the test that checks it.
Out: `Shim.needed()` (is the installed version in that range), `mark_applied` / `applied()`:
     the names of the shims applied in this process, in order, each once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion

# where a version lives when the distribution metadata is missing (a source checkout on PYTHONPATH)
_VERSION_MODULES = {"megatron-core": "megatron.core.package_info", "mbridge": "mbridge",
                    "transformers": "transformers", "vllm": "vllm"}
_APPLIED: list[str] = []


@functools.lru_cache(maxsize=None)
def installed_version(package: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    module = _VERSION_MODULES.get(package)
    if module is None:
        return None
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return None


@dataclass(frozen=True)
class Shim:
    """One compatibility fix. `needed` is where it is needed, read from the sources in `read`;
    `condition` says in words what else must hold at run time (checked by its apply function)."""

    home: str  # the compat module: megatron_core | mbridge | transformers
    name: str
    package: str  # the distribution whose behaviour it works around
    needed: str  # PEP 440 version range
    read: str  # the versions whose source set the range
    fixes: str
    test: str  # tests/<file>.py::<test function>
    condition: str = ""

    @property
    def key(self) -> str:
        return f"{self.home}.{self.name}"

    def needed_on(self, version: str) -> bool:
        try:
            return SpecifierSet(self.needed).contains(version, prereleases=True)
        except InvalidVersion:
            return False

    def needed_here(self) -> bool:
        """True when the installed version of `package` is in the `needed` range."""
        version = installed_version(self.package)
        return version is not None and self.needed_on(version)


def mark_applied(shim: Shim) -> None:
    if shim.key not in _APPLIED:
        _APPLIED.append(shim.key)


def applied() -> list[str]:
    """Keys ('home.name') of the shims applied in this process, in the order they were applied."""
    return list(_APPLIED)
