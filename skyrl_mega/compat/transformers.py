"""transformers shims: HF config fields that moved in transformers 5 but mbridge still reads.

In:  an HF config (AutoConfig), right after loading. Out: the same config, with the fields mbridge
     reads filled in where the guard holds (`SHIMS`), recorded in `skyrl_mega.compat.applied()`.
"""

from __future__ import annotations

from .guard import Shim, mark_applied

SHIMS = (
    Shim("transformers", "rope_theta", "transformers", ">=5.0",
         "5.24.0 (installed); the v5 migration guide moves rope_theta into rope_parameters",
         "transformers 5 keeps rope_theta inside rope_parameters; mbridge 0.15.1 builds GPTModel "
         "from hf_config.rope_theta", "tests/test_compat.py::test_rope_theta_from_rope_parameters",
         "the config has no rope_theta"),
)
_ROPE = SHIMS[0]


def fix_hf_config(hf_config):
    """Sets hf_config.rope_theta from rope_parameters (10000.0 when neither has it) when the
    `rope_theta` guard holds and the config lacks it. Returns the config."""
    if not _ROPE.needed_here():
        return hf_config
    if getattr(hf_config, "rope_theta", None) is None:
        rope = getattr(hf_config, "rope_parameters", None) or {}
        hf_config.rope_theta = rope.get("rope_theta", 10000.0)
        mark_applied(_ROPE)
    return hf_config
