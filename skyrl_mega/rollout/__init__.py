"""Rollout: vLLM server processes, vllm-router, async HTTP client, control plane, R3 wire
format, and the vLLM plugin that runs inside the engines (weight transports: skyrl_mega.weight_sync).

    servers.ServerManager / ServerConfig    start, watch, restart, stop vLLM servers
    router.RouterProcess                    vllm-router in front (data plane only)
    client.RolloutClient / SamplingParams   token ids in; tokens, logprobs, routes out
    control.EngineControl                   control calls to EVERY server directly
    r3_wire                                 routed-experts decode / layer map / encode
    vllm_plugin                             register() + SkyrlWorkerExtension (engine side)

Names are imported lazily: vLLM imports this package (for the plugin) in every process.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ServerConfig": "servers",
    "ServerManager": "servers",
    "RouterProcess": "router",
    "RolloutClient": "client",
    "SamplingParams": "client",
    "Sample": "client",
    "Generation": "client",
    "generate_sync": "client",
    "EngineControl": "control",
    "RolloutError": "errors",
    "RolloutConnectionError": "errors",
    "RolloutTimeoutError": "errors",
    "RolloutHTTPError": "errors",
    "RolloutBadRequestError": "errors",
    "RolloutResponseError": "errors",
    "ServerStartError": "errors",
    "ControlError": "errors",
    "WeightSyncError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
