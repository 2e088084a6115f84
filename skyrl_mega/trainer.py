"""The synchronous RL loop. torchrun starts every rank here; rank 0 is also the controller.

    prompts -> rollout (vLLM, routes when R3 is on) -> rewards -> advantages
            -> train (all ranks: train.mini_batches x train.epochs updates) -> weight sync to the engines -> metrics -> checkpoint

In: a recipe YAML + overrides (argv). Out: <output_dir>/metrics.jsonl, plot.png, checkpoints/
(dist-ckpt, resumable), hf/ (HF export). Rank 0 owns the engines, the data and the metrics;
every rank owns its Megatron shards. Data crosses ranks only as typed tensors.
"""

from __future__ import annotations

import os
import sys
import time

from .config import load_config, validate_config
from .controller import gpu_memory
from .controller.batch_transfer import broadcast_rl_batch
from .controller.log import log0
from .controller.steps import (on_rank0, resume, rollout_with_retries, save_due, save_final,
                               sync_with_retries)
from .errors import run_rank
from .megatron import parallel
from .megatron.packing import mini_batches, shard_for_dp
from .megatron.policy import build_policy, build_reference
from .megatron.train_step import train_on_batch


def main(argv: list[str]) -> None:
    # argv: [RECIPE] [Hydra overrides]; RECIPE is a path or <family>/<size> (no '=', no '~')
    recipe = argv[0] if argv and "=" not in argv[0] and not argv[0].startswith("~") else None
    cfg = load_config(recipe, argv[1:] if recipe else argv)
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    steps = cfg.train.steps
    policy = build_policy(cfg, total_steps=steps)
    ref = build_reference(cfg) if cfg.algorithm.use_reference else None
    ckpt_root = cfg.checkpoint.dir or os.path.join(cfg.output_dir, "checkpoints")
    start, state = resume(cfg, ckpt_root, policy.models, policy.optimizer, policy.scheduler)
    policy.step = start
    ctrl = metrics_log = None
    try:
        ctrl, metrics_log = on_rank0("starting the controller", start_controller, cfg, policy, state,
                                     start) or (None, None)
        log0(f"{'resuming from step ' + str(start) if start else 'starting'}; world size {world}, "
             f"tp={cfg.parallel.tp} pp={cfg.parallel.pp} ep={cfg.parallel.ep}")
        initial = sync_with_retries(cfg, ctrl, policy, version=start, first=True)  # logged with the first step

        for step in range(start, steps):
            t0 = time.perf_counter()
            with gpu_memory.phase("rollout") as mem:
                result = rollout_with_retries(cfg, ctrl, policy, step, version=step)   # rank 0 only
            batch, metrics = (result[0], {**result[1], **mem}) if result else (None, {})
            if step == start:
                metrics.update({k.replace("weight_sync/", "initial_sync/"): v for k, v in initial.items()})
            t_rollout = time.perf_counter() - t0
            metrics.update(on_rank0("putting the engines to sleep", lambda: ctrl.engines.before_training()) or {})
            batch = broadcast_rl_batch(batch)
            mine = [mini.select(shard_for_dp(mini.lengths, mpu.get_data_parallel_world_size(),
                                             mpu.get_data_parallel_rank()))
                    for mini in mini_batches(batch, cfg.train.mini_batches)]
            t1 = time.perf_counter()
            with gpu_memory.phase("train") as mem:
                metrics.update(train_on_batch(policy, mine, cfg, ref))
            metrics.update(mem)
            t_train = time.perf_counter() - t1
            metrics.update(on_rank0("waking the engines' weights", lambda: ctrl.engines.before_sync()) or {})
            with gpu_memory.phase("sync") as mem:
                metrics.update(sync_with_retries(cfg, ctrl, policy, version=step + 1))
            metrics.update(mem)
            metrics.update(on_rank0("waking the engines' KV cache", lambda: ctrl.engines.before_rollout()) or {})
            step_s = time.perf_counter() - t0
            metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train, "time/step_s": step_s,
                            "tokens_per_s": sum(batch.lengths) / step_s})
            # logged before the checkpoint: a step whose checkpoint exists has its metrics on disk
            on_rank0("logging metrics", lambda: metrics_log.log(step, metrics))
            save_due(cfg, policy, ctrl, ckpt_root, step + 1)

        hf_dir = save_final(cfg, policy, ctrl, ckpt_root)
        if ctrl is not None:
            from .controller.report import finish_report

            finish_report(cfg, metrics_log, ckpt_root, steps, hf_dir)
    finally:
        if ctrl is not None:
            ctrl.engines.stop()
        parallel.destroy()


def start_controller(cfg, policy, state: dict, start: int):
    """Rank 0: data, engines and metrics sinks; a resumed run continues the sampler."""
    from .controller.controller import Controller
    from .controller.metrics import MetricsLogger

    ctrl = Controller(cfg, policy.bridge)
    if "sampler" in state:
        ctrl.sampler.load_state(state["sampler"])
    log0(f"starting engines (placement={cfg.placement}, transport={ctrl.engines.plan.transport})")
    try:
        ctrl.engines.start()
        t = ctrl.engines.transport
        log0(f"engines at {', '.join(ctrl.engines.servers.urls)}; weights from "
             f"{getattr(t, 'master_address', 'this host')} ({type(t).__name__})")
        return ctrl, MetricsLogger(cfg, cfg.train.steps, start)
    except BaseException:
        ctrl.engines.stop()
        raise


if __name__ == "__main__":
    sys.exit(run_rank(main, sys.argv[1:]))  # a UserError: one line, exit code 2
