"""The rollout side of the RL loop, on the controller (global rank 0).

In: the config, the HF config and the MoE layer numbers. Out: `RolloutEngines`: vLLM servers
started here (or external URLs), vllm-router in front, sampling with per-request seeds,
routed experts for MoE layers only, and the weight transport and sleep/wake behaviour that
the placement implies (placement.py). A server that dies is restarted by the manager; the
trainer then re-syncs weights and retries the step.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from . import gpu_memory
from .placement import PlacementPlan, plan_placement
from ..rollout.client import RolloutClient, Sample, SamplingParams
from ..rollout.control import EngineControl
from ..rollout.router import RouterProcess
from ..rollout.servers import ServerConfig, ServerManager


@dataclass
class PromptSamples:
    prompt_ids: list[int]
    samples: list[Sample]


def request_seed(base: int, step: int, prompt: int, sample: int) -> int:
    """Deterministic, distinct seeds per (step, prompt, sample): resumed runs resample alike."""
    return (base * 1_000_003 + step * 10_007 + prompt * 101 + sample) % (2**31 - 1)


def server_config(cfg, plan: PlacementPlan, host: str = "127.0.0.1") -> ServerConfig:
    """The vLLM server a recipe asks for under `plan` (the trainer's own servers, and
    `skyrl-mega serve` for engines a job script starts elsewhere)."""
    r, gpu = cfg.rollout, plan.device == "gpu"
    return ServerConfig(model=cfg.model.path, dtype=r.dtype, max_model_len=r.max_model_len, host=host,
                        kv_cache_gib=r.kv_cache_gib, seed=r.seed,
                        return_routed_experts=bool(cfg.algorithm.routing_replay), device=plan.device,
                        tensor_parallel_size=r.engine_tp if gpu else 1,
                        gpu_memory_utilization=r.gpu_memory_utilization if gpu else None,
                        sleep_mode=bool(plan.sleep_level), enforce_eager=r.enforce_eager,
                        max_num_seqs=r.max_num_seqs, extra_args=plan.server_args() + list(r.extra_args))


class RolloutEngines:
    def __init__(self, cfg, moe_layers: list[int], num_hidden_layers: int, num_experts: int):
        self.cfg = cfg
        r = cfg.rollout
        self.plan: PlacementPlan = plan_placement(cfg.placement, r)
        self.log_dir = r.log_dir or os.path.join(cfg.output_dir, "engine_logs")
        self.routes = bool(cfg.algorithm.routing_replay)
        gpu = self.plan.device == "gpu"
        server_cfg = None if r.external_urls else server_config(cfg, self.plan)
        needs = ["rollout", "control"] + (["weight_transfer"] if self.plan.transport != "shm" else []) \
            + (["sleep"] if self.plan.sleep_level else [])
        self.servers = ServerManager(server_cfg, num_servers=r.num_servers, external_urls=r.external_urls or None,
                                     log_dir=self.log_dir, startup_timeout_s=r.startup_timeout_s, watch=False,
                                     devices=(list(r.engine_gpus) or None) if gpu else None, needs=needs)
        self.router: RouterProcess | None = None
        self.client_kwargs = dict(max_concurrency=r.max_concurrency, deadline_s=r.request_deadline_s,
                                  return_routed_experts=self.routes, moe_layers=moe_layers,
                                  num_hidden_layers=num_hidden_layers, num_experts=num_experts,
                                  max_model_len=r.max_model_len)
        self.control: EngineControl | None = None
        self.transport = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "RolloutEngines":
        self.servers.start()
        if self.cfg.rollout.use_router:
            self.router = RouterProcess(self.servers.urls, log_dir=self.log_dir).start()
        self.control = EngineControl(self.servers.urls, caps=self.servers.caps)
        kw = {"channel": self.cfg.rollout.worker_channel} if self.plan.transport == "cuda_ipc" else {}
        self.transport = self.plan.make_transport(self.control, **kw)
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        self.servers.stop()

    @property
    def data_url(self) -> str:
        return self.router.url if self.router is not None else self.servers.urls[0]

    def restart_dead(self) -> list[int]:
        """After a failed rollout or sync: restarts servers that are gone, dying or hung
        (ServerManager.settle; they come back with the checkpoint's weights: re-sync!).
        A bucketed transport then forms its transfer group anew at the next sync (the
        restarted servers join it; the others leave the old one)."""
        restarted = self.servers.settle()
        if restarted and self.router is not None:
            self.router.stop()
            self.router = RouterProcess(self.servers.urls, log_dir=self.log_dir).start()
        if restarted:
            self.control.forget_sleep()  # a restarted server runs awake: the next sync pauses it
            self.transport.reset()
        return restarted

    # -- placement: colocated GPU engines sleep while the trainer works --------------------------
    def before_training(self) -> dict:
        """Sleep (level 1: weights to host memory, KV cache freed; 2: both freed)."""
        return self._sleep_phase("engine/sleep", lambda: self.control.sleep(self.plan.sleep_level))

    def before_sync(self) -> dict:
        """Wake the weights only: the sync writes them while the trainer still holds its memory."""
        return self._sleep_phase("engine/wake_weights", lambda: self.control.wake_up(tags=["weights"]))

    def before_rollout(self) -> dict:
        """Wake the KV cache: the engine is whole again."""
        return self._sleep_phase("engine/wake_kv", lambda: self.control.wake_up(tags=["kv_cache"]))

    def _sleep_phase(self, name: str, call) -> dict:
        """Runs a sleep/wake call where the placement sleeps engines; its time and freed memory."""
        if not self.plan.sleep_level:
            return {}
        with gpu_memory.freed(name) as m:
            call()
        return m

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], step: int) -> list[PromptSamples]:
        """n samples per prompt, one request each with its own seed (vLLM's n>1 shares a seed)."""
        r = self.cfg.rollout
        eos = self._eos_ids()

        async def run():
            async with RolloutClient(self.data_url, **self.client_kwargs) as client:
                tasks = []
                for p, ids in enumerate(prompts):
                    for s in range(r.n_samples_per_prompt):
                        sp = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                            n=1, seed=request_seed(r.seed, step, p, s), stop_token_ids=eos)
                        tasks.append(client.generate(ids, sp))
                return await asyncio.gather(*tasks)

        gens = asyncio.run(run())
        n = r.n_samples_per_prompt
        return [PromptSamples(list(prompts[p]), [g.samples[0] for g in gens[p * n:(p + 1) * n]])
                for p in range(len(prompts))]

    def _eos_ids(self) -> list[int] | None:
        import json

        cfg_file = os.path.join(self.cfg.model.path, "generation_config.json")
        if os.path.exists(cfg_file):
            eos = json.load(open(cfg_file)).get("eos_token_id")
            return [eos] if isinstance(eos, int) else eos
        return None
