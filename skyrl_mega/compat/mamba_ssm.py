"""mamba-ssm / causal-conv1d shim: stand-in modules where those GPU packages are absent.

In:  `apply_mamba_kernel_standins()`, called by the hybrid model build (before megatron's Mamba
     modules are imported) in a process without the real packages.
Out: importable `mamba_ssm.ops.triton.{ssd_combined, layernorm_gated, selective_state_update}`
     and `causal_conv1d{, .causal_conv1d_varlen}` whose functions are the project's plain-PyTorch
     kernels (skyrl_mega/megatron/kernels/), so megatron-core's own MambaMixer (with its TP / CP
     splits, packed sequences and dist-ckpt layout) runs on CPU. Nothing is replaced where the
     real package imports: a GPU machine with mamba-ssm built keeps its kernels.

Triton only (`triton_only`): mamba-ssm installed from source without its CUDA extension (its
Triton kernels need no build) imports only without its package __init__; it is registered so,
and causal_conv1d is served by the stand-in, `cpp_functions` included: mamba-ssm's fused Triton
path (`mamba_split_conv1d_scan_combined`, megatron's memory-efficient path, the only one that
takes packed sequences) then runs its real scan with the stand-in conv.

Why a module stand-in and not a subclass: megatron's mamba_mixer.py binds the kernel names at
import (`from mamba_ssm.ops.triton.ssd_combined import ...`), raises in MambaMixer.__init__
when they were absent and builds its norm from mamba_ssm's RMSNorm class; read in megatron-core
0.16.1 and 0.19.2 (identical imports). The stand-ins report the API versions they implement
(`API_VERSIONS`, with a "+skyrl.cpu" local label) for megatron's packed-sequence version check.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
import types

from .guard import Shim, mark_applied

_READ = "0.16.1, 0.19.2"
SHIMS = (
    Shim("mamba_ssm", "kernel_standins", "megatron-core", ">=0.16.1,<0.20", _READ,
         "megatron's MambaMixer imports mamba_ssm / causal_conv1d kernels at import and raises "
         "without them; stand-in modules serve the project's PyTorch kernels under those names",
         "tests/test_kernels_mamba.py::test_megatron_mamba_mixer_on_the_standins_equals_transformers",
         "mamba_ssm and causal_conv1d are not importable, megatron.core.ssm.mamba_mixer not yet imported"),
    Shim("mamba_ssm", "triton_only", "mamba-ssm", ">=2.2,<2.4", "2.3.2.post1 (source): mamba_ssm/__init__.py "
         "imports ops/selective_scan_interface.py, which imports the CUDA extension selective_scan_cuda",
         "a mamba-ssm source tree without its compiled CUDA extension cannot be imported at all, though "
         "the Triton kernels megatron uses (ops/triton/) need no compilation: the package is registered "
         "without running its __init__, so those modules load from the installed files",
         "tests/test_kernels_mamba.py::test_triton_only_mamba_ssm_loads_without_its_init",
         "mamba_ssm is installed, its __init__ fails for want of selective_scan_cuda"),
)
API_VERSIONS = {"mamba_ssm": "2.2.6.post3+skyrl.cpu", "causal_conv1d": "1.5.3.post1+skyrl.cpu"}
_MIXER = "megatron.core.ssm.mamba_mixer"


def _real(name: str) -> bool:
    mod = sys.modules.get(name)
    if mod is not None:
        return not getattr(mod, "__skyrl_standin__", False)
    return importlib.util.find_spec(name) is not None


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    m.__path__ = []
    m.__skyrl_standin__ = True
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, m)
    return m


def _register_triton_only_mamba_ssm() -> bool:
    """Where mamba_ssm is installed but its __init__ cannot import (no compiled selective_scan_cuda),
    registers the package without running its __init__ (its __version__ read from that file):
    `mamba_ssm.ops.triton.*` then load from the installed files. True when registered (or
    importable as a whole)."""
    if "mamba_ssm" in sys.modules:
        return True
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        return False
    if importlib.util.find_spec("selective_scan_cuda") is not None:
        return True  # the whole package imports
    pkg = types.ModuleType("mamba_ssm")
    pkg.__spec__ = importlib.machinery.ModuleSpec("mamba_ssm", loader=None, is_package=True)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)", open(spec.origin).read(), re.M) if spec.origin else None
    if found:  # megatron's packed-sequence check reads it (a source tree has no dist-info)
        pkg.__version__ = found.group(1)
    sys.modules["mamba_ssm"] = pkg
    import mamba_ssm.ops.triton.ssd_combined  # noqa: F401  (fails here, not inside megatron, if broken)

    mark_applied(SHIMS[1])
    return True


def _register_conv1d_standin() -> None:
    from ..megatron.kernels import conv1d

    _module("causal_conv1d", __version__=API_VERSIONS["causal_conv1d"],
            causal_conv1d_fn=conv1d.causal_conv1d_fn, causal_conv1d_update=conv1d.causal_conv1d_update)
    _module("causal_conv1d.causal_conv1d_varlen", causal_conv1d_varlen_states=conv1d.causal_conv1d_varlen_states)
    _module("causal_conv1d.cpp_functions", causal_conv1d_fwd_function=conv1d.causal_conv1d_fwd_function,
            causal_conv1d_bwd_function=conv1d.causal_conv1d_bwd_function,
            causal_conv1d_update_function=conv1d.causal_conv1d_update_function)


def apply_mamba_kernel_standins() -> bool:
    """Registers the stand-ins where the real packages are absent; True when they are in use.
    The conv stand-in goes in first: mamba-ssm's Triton module binds causal-conv1d's functions
    when it is imported. Raises RuntimeError when megatron's mixer was already imported without
    kernels (too late)."""
    shim = SHIMS[0]
    if _real("mamba_ssm") and _real("causal_conv1d"):
        _register_triton_only_mamba_ssm()
        return False
    if not shim.needed_here():
        raise RuntimeError(f"no Mamba kernels: mamba_ssm / causal_conv1d are not installed and the CPU "
                           f"stand-ins are checked against megatron-core {shim.needed} only")
    if "mamba_ssm" in sys.modules and "causal_conv1d" in sys.modules:
        return True  # applied before in this process
    mixer = sys.modules.get(_MIXER)
    if mixer is not None and not getattr(mixer, "HAVE_MAMBA_SSM", False):
        raise RuntimeError(f"{_MIXER} was imported before the Mamba kernel stand-ins were registered; "
                           "call skyrl_mega.compat.mamba_ssm.apply_mamba_kernel_standins() first")
    from ..megatron.kernels import gated_rmsnorm, ssd

    if not _real("causal_conv1d"):
        _register_conv1d_standin()
    if _real("mamba_ssm"):
        _register_triton_only_mamba_ssm()
    else:
        _module("mamba_ssm", __version__=API_VERSIONS["mamba_ssm"])
        _module("mamba_ssm.ops")
        _module("mamba_ssm.ops.triton")
        _module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=ssd.mamba_chunk_scan_combined,
                mamba_split_conv1d_scan_combined=ssd.mamba_split_conv1d_scan_combined)
        _module("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=gated_rmsnorm.RMSNorm,
                rmsnorm_fn=gated_rmsnorm.gated_rmsnorm)
        _module("mamba_ssm.ops.triton.selective_state_update", selective_state_update=ssd.selective_state_update)
    mark_applied(shim)
    return True
