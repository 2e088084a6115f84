"""flash-linear-attention (fla) shim: stand-in modules where that Triton-only package is absent.

In:  `apply_fla_kernel_standins()`, called before megatron's GatedDeltaNet module is imported, in
     a process where `fla` does not import (CPU machines: fla's kernels are Triton only).
Out: importable `fla.modules.l2norm` (l2norm) and `fla.ops.gated_delta_rule`
     (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) whose functions are the project's
     plain-PyTorch kernels (skyrl_mega/megatron/kernels/gated_delta_rule.py, fla 0.5.2's API), so
     megatron-core's own GatedDeltaNet (Qwen3.5's linear-attention layers) runs on CPU. Nothing is
     replaced where the real package imports: a GPU machine with fla keeps its kernels.

Why a module stand-in: megatron's gated_delta_net.py binds the kernels at import
(`from fla.modules.l2norm import l2norm`, `from fla.ops.gated_delta_rule import
chunk_gated_delta_rule`, HAVE_FLA) and GatedDeltaNet.__init__ raises without them; read in
megatron-core 0.16.1 and 0.17.1 (identical imports). From 0.18 megatron also imports
`fla.modules.convolution.causal_conv1d` in the same block (0.18.2, and 0.19.0's
ssm/gated_delta_net/common.py), which this shim does not serve, hence the range <0.18. The
stand-in package reports the fla version whose API it implements (`API_VERSION`, with a
"+skyrl.cpu" local label).
"""

from __future__ import annotations

import sys

from .guard import Shim, mark_applied
from .mamba_ssm import _module, _real  # the same stand-in module helpers

_READ = "0.16.1, 0.17.1, 0.18.2, 0.19.0"
SHIMS = (
    Shim("fla", "kernel_standins", "megatron-core", ">=0.16.1,<0.18", _READ,
         "megatron's GatedDeltaNet imports fla's l2norm / chunk_gated_delta_rule at import and raises "
         "without them; stand-in modules serve the project's PyTorch kernels under those names",
         "tests/test_kernels_gdn.py::test_fla_standins_serve_megatron_gated_delta_net",
         "fla is not importable, megatron.core.ssm.gated_delta_net not yet imported"),
)
API_VERSION = "0.5.2+skyrl.cpu"
_GDN = "megatron.core.ssm.gated_delta_net"


def apply_fla_kernel_standins() -> bool:
    """Registers the stand-ins where fla is absent; True when they are in use. Raises RuntimeError
    when megatron's GatedDeltaNet module was already imported without fla (too late)."""
    shim = SHIMS[0]
    if _real("fla"):
        return False
    if not shim.needed_here():
        raise RuntimeError(f"no Gated DeltaNet kernels: fla is not installed and the CPU stand-ins are "
                           f"checked against megatron-core {shim.needed} only")
    if "fla" in sys.modules:
        return True  # applied before in this process
    gdn = sys.modules.get(_GDN)
    if gdn is not None and not getattr(gdn, "HAVE_FLA", False):
        raise RuntimeError(f"{_GDN} was imported before the fla kernel stand-ins were registered; "
                           "call skyrl_mega.compat.fla.apply_fla_kernel_standins() first")
    from ..megatron.kernels import gated_delta_rule as gdr

    _module("fla", __version__=API_VERSION)
    _module("fla.modules")
    _module("fla.modules.l2norm", l2norm=gdr.l2norm, l2_norm=gdr.l2_norm)
    _module("fla.ops")
    _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=gdr.chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule=gdr.fused_recurrent_gated_delta_rule,
            chunk_gdn=gdr.chunk_gdn, fused_recurrent_gdn=gdr.fused_recurrent_gdn)
    mark_applied(shim)
    return True
