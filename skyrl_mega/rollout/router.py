"""vllm-router (0.1.17) in front of the vLLM servers: the data plane only.

In: worker URLs. Out: one URL that load-balances /inference/v1/generate (and the OpenAI
routes) over them. Control calls (pause/resume, sleep/wake, weight updates, reset prefix
cache) must NOT go through it: the router forwards such a call to one backend only, so
use `EngineControl(server_urls)` for those.

    with RouterProcess(sm.urls, log_dir="runs/logs") as router:
        client = RolloutClient(router.url)

The router itself waits (up to --worker-startup-timeout-secs) for every worker to be
healthy before it listens, so "router healthy" implies "workers were healthy".

A dead worker: the router answers 500 ("Request failed: error sending request") at once,
then 503 ("No available workers (all circuits open or unhealthy)") while its circuit
breaker is open. With the router's defaults it took 57 s after the worker was healthy
again to route to it; with --cb-timeout-duration-secs 2 --health-success-threshold 1
(the defaults here) it routes again at once. The client retries 5xx, so a restarted
server simply picks the retried requests up. The router's own retries are off
(--disable-retries): when they were on, a server that came back quickly answered the router's
retry, and the client could not tell that its request had been cut off and run again.
CLI flags used (checked with `vllm-router --help`): --host --port --worker-urls --policy
--prometheus-port (default 29000 would collide between routers) --health-check-interval-secs
--health-success-threshold --cb-timeout-duration-secs --worker-startup-timeout-secs
--request-timeout-secs --log-level --disable-retries.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Sequence

from ..ports import free_ports
from .procs import ChildProcess, wait_healthy


def router_executable() -> list[str]:
    exe = shutil.which("vllm-router")
    if exe is None:
        venv_exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
        if os.path.exists(venv_exe):
            exe = venv_exe
    if exe is not None:
        return [exe]
    return [sys.executable, "-m", "vllm_router.launch_router"]


class RouterProcess:
    """A vllm-router child process (own process group, logs to a file)."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        log_dir: str = "runs/rollout_logs",
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "round_robin",
        health_check_interval_s: int = 2,
        health_success_threshold: int = 1,
        circuit_breaker_timeout_s: int = 2,
        worker_startup_timeout_s: int = 300,
        request_timeout_s: int = 3600,
        startup_timeout_s: float = 120.0,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
    ):
        if not worker_urls:
            raise ValueError("RouterProcess needs at least one worker URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host = host
        if port:
            self.port, metrics_port = port, free_ports(1, host, exclude=(port,))[0]
        else:
            self.port, metrics_port = free_ports(2, host)
        self.url = f"http://{host}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        argv = router_executable() + [
            "--host", host,
            "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--policy", policy,
            "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", str(health_check_interval_s),
            "--health-success-threshold", str(health_success_threshold),
            "--cb-timeout-duration-secs", str(circuit_breaker_timeout_s),
            "--worker-startup-timeout-secs", str(worker_startup_timeout_s),
            "--request-timeout-secs", str(request_timeout_s),
            "--log-level", log_level,
            "--disable-retries",  # retries live in one place: the client (deadline, fresh request ids)
            *extra_args,
        ]
        self.child = ChildProcess("vllm-router", argv, os.path.join(log_dir, "vllm_router.log"))

    @property
    def log_path(self) -> str:
        return self.child.log_path

    def start(self) -> "RouterProcess":
        self.child.start()
        try:
            wait_healthy(self.url + "/health", self.startup_timeout_s, child=self.child, what="vllm-router")
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self, grace_s: float = 5.0) -> None:
        self.child.stop(grace_s=grace_s)

    def __enter__(self) -> "RouterProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
