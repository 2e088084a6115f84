"""The synchronous RL loop. torchrun starts every rank here; rank 0 is also the controller.

    prompts -> rollout (vLLM, routes when R3 is on) -> rewards -> advantages
            -> train step (all ranks) -> weight sync to the engines -> metrics -> checkpoint

In: a recipe YAML + overrides (argv). Out: <output_dir>/metrics.jsonl, plot.png, checkpoints/
(dist-ckpt, resumable), hf/ (HF export). Rank 0 owns the engines, the data and the metrics;
every rank owns its Megatron shards. Data crosses ranks only as typed tensors.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from .batch_transfer import broadcast_rl_batch
from .checkpoint import find_latest, load_checkpoint, save_checkpoint
from .checkpoint.dist_ckpt import step_dir
from .config import load_config, validate_config
from .megatron import parallel
from .megatron.packing import shard_for_dp
from .megatron.train_step import build_policy, build_reference, train_step
from .weight_sync.sync import sync_weights


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[skyrl-mega] {msg}", flush=True)


def bcast_int(value: int) -> int:
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.broadcast(t, 0)
    return int(t.item())


class Controller:
    """Rank 0's half: data, engines, rewards. Built only on rank 0."""

    def __init__(self, cfg, bridge):
        from transformers import AutoTokenizer

        from .data.dataset import PromptSampler, load_prompts
        from .data.synthetic import write_digits_task
        from .engines import RolloutEngines

        d = cfg.data
        if d.synthetic and not os.path.exists(d.train_path):
            write_digits_task(d.train_path, n=d.synthetic_size, seed=cfg.train.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.items, counts = load_prompts(d.train_path, self.tokenizer, chat_template=d.chat_template,
                                          max_prompt_len=d.max_prompt_len)
        log0(f"dataset {d.train_path}: {counts}")
        self.sampler = PromptSampler(len(self.items), cfg.rollout.prompts_per_step, cfg.train.seed, d.shuffle)
        hf = bridge.hf_config
        self.engines = RolloutEngines(cfg, bridge.moe_layers, hf.num_hidden_layers,
                                      getattr(hf, "num_experts", 0) or 0)
        self.cfg = cfg

    def rollout(self, step: int):
        from .rollout_batch import build_rl_batch

        items = [self.items[i] for i in self.sampler.next_batch()]
        rollouts = self.engines.generate([it.prompt_ids for it in items], step)
        return build_rl_batch(self.cfg, self.tokenizer, items, rollouts)


def resume_step(cfg, ckpt_root: str) -> int:
    """Rank 0 picks the checkpoint (the newest that verifies); every rank learns its step."""
    step = 0
    if dist.get_rank() == 0 and cfg.checkpoint.resume != "none":
        path = find_latest(ckpt_root, log=log0) if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume
        if path:
            step = int(os.path.basename(path.rstrip("/")).split("_")[-1])
    return bcast_int(step)


def rollout_with_retries(cfg, ctrl, policy, step: int, version: int):
    """Collective. A failed rollout (e.g. a dead server) restarts servers, re-syncs weights, retries."""
    from .rollout.errors import RolloutError

    sampler_state = ctrl.sampler.state() if ctrl is not None else None
    for attempt in range(cfg.rollout.max_step_retries + 1):
        result, ok = None, 1
        if ctrl is not None:
            try:
                result = ctrl.rollout(step)
            except RolloutError as e:
                ok = 0
                log0(f"step {step}: rollout failed (attempt {attempt + 1}): {str(e)[:300]}")
                restarted = ctrl.engines.restart_dead()
                log0(f"restarted servers {restarted}; re-syncing weights version {version}")
                ctrl.sampler.load_state(sampler_state)  # the retry draws the same prompts
        if bcast_int(ok):
            return result
        sync_with_retries(cfg, ctrl, policy, ctrl.engines.transport if ctrl else None, version)
    raise RuntimeError(f"step {step}: rollout failed {cfg.rollout.max_step_retries + 1} times")


def sync_with_retries(cfg, ctrl, policy, transport, version: int) -> dict:
    """Collective. A sync that fails (every rank raises, e.g. a server died) restarts dead
    servers on rank 0 and sends the same weights again."""
    from .rollout.errors import WeightSyncError

    for attempt in range(cfg.rollout.max_step_retries + 1):
        try:
            return sync_weights(policy.bridge, policy.models, transport, version=version)
        except WeightSyncError as e:
            log0(f"weight sync {version} failed (attempt {attempt + 1}): {str(e)[:300]}")
            if ctrl is not None:
                log0(f"restarted servers {ctrl.engines.restart_dead()}; sending version {version} again")
            dist.barrier()
    raise RuntimeError(f"weight sync {version} failed {cfg.rollout.max_step_retries + 1} times")


def main(argv: list[str]) -> None:
    recipe = argv[0] if argv and argv[0].endswith(".yaml") else None
    cfg = load_config(recipe, argv[1:] if recipe else argv)
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    steps = cfg.train.steps
    policy = build_policy(cfg, total_steps=steps)
    ref = build_reference(cfg) if cfg.algorithm.use_reference else None
    ckpt_root = cfg.checkpoint.dir or os.path.join(cfg.output_dir, "checkpoints")
    start = resume_step(cfg, ckpt_root)
    state = load_checkpoint(step_dir(ckpt_root, start), policy.models, policy.optimizer, policy.scheduler) \
        if start else {}
    policy.step = start
    ctrl = Controller(cfg, policy.bridge) if rank == 0 else None
    metrics_log = None
    try:
        if ctrl is not None:
            if "sampler" in state:
                ctrl.sampler.load_state(state["sampler"])
            log0(f"starting engines (placement={cfg.placement}, transport={ctrl.engines.plan.transport})")
            ctrl.engines.start()
            from .metrics import MetricsLogger

            metrics_log = MetricsLogger(cfg, steps, start)
        log0(f"{'resuming from step ' + str(start) if start else 'starting'}; world size {world}, "
             f"tp={cfg.parallel.tp} pp={cfg.parallel.pp} ep={cfg.parallel.ep}")
        transport = ctrl.engines.transport if ctrl is not None else None  # rank 0 sends, others export
        sync_with_retries(cfg, ctrl, policy, transport, version=start)

        for step in range(start, steps):
            t0 = time.perf_counter()
            result = rollout_with_retries(cfg, ctrl, policy, step, version=step)   # rank 0 only
            batch, metrics = (result[0], dict(result[1])) if result else (None, {})
            t_rollout = time.perf_counter() - t0
            if ctrl is not None:
                ctrl.engines.before_training()                                      # colocated: sleep
            batch = broadcast_rl_batch(batch)
            mine = batch.select(shard_for_dp(batch.lengths, mpu.get_data_parallel_world_size(),
                                             mpu.get_data_parallel_rank()))
            t1 = time.perf_counter()
            metrics.update(train_step(policy, mine, cfg, ref))
            t_train = time.perf_counter() - t1
            if ctrl is not None:
                ctrl.engines.before_rollout()                                       # colocated: wake
            metrics.update(sync_with_retries(cfg, ctrl, policy, transport, version=step + 1))
            save_due(cfg, policy, ctrl, ckpt_root, step + 1)
            step_s = time.perf_counter() - t0
            metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train, "time/step_s": step_s,
                            "tokens_per_s": sum(batch.lengths) / step_s})
            if metrics_log is not None:
                metrics_log.log(step, metrics)

        hf_dir = save_final(cfg, policy, ctrl, ckpt_root)
        if ctrl is not None:
            finish_report(cfg, metrics_log, ckpt_root, steps, hf_dir)
    finally:
        if ctrl is not None:
            ctrl.engines.stop()
        parallel.destroy()


def _trainer_state(ctrl) -> dict:
    return {"sampler": ctrl.sampler.state() if ctrl is not None else None}


def save_due(cfg, policy, ctrl, ckpt_root: str, done: int) -> None:
    """Collective: the periodic dist-ckpt and HF exports after `done` steps."""
    c = cfg.checkpoint
    if c.every_n_steps and done % c.every_n_steps == 0 and done < cfg.train.steps:
        save_checkpoint(ckpt_root, done, policy.models, policy.optimizer, policy.scheduler, _trainer_state(ctrl),
                        c.keep_last)
    if c.hf_export_every_n_steps and done % c.hf_export_every_n_steps == 0:
        policy.bridge.save_hf(policy.models, os.path.join(cfg.output_dir, "hf", f"step_{done}"))


def save_final(cfg, policy, ctrl, ckpt_root: str) -> str:
    """Collective: the last checkpoint, and the HF export when asked. Returns the HF dir."""
    save_checkpoint(ckpt_root, cfg.train.steps, policy.models, policy.optimizer, policy.scheduler,
                    _trainer_state(ctrl), cfg.checkpoint.keep_last)
    hf_dir = os.path.join(cfg.output_dir, "hf", "final")
    if cfg.checkpoint.hf_export_at_end:
        policy.bridge.save_hf(policy.models, hf_dir)
    return hf_dir


def finish_report(cfg, metrics_log, ckpt_root: str, steps: int, hf_dir: str) -> None:
    from .metrics import plot_metrics, read_metrics

    metrics_log.close()
    rows = read_metrics(metrics_log.path)
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards) // 2) or 1
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"\n[skyrl-mega] mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
          f"({last / max(first, 1e-9):.1f}x)")
    diffs = [r.get("logprob_diff_max", float("nan")) for r in rows]
    print(f"[skyrl-mega] max |rollout - train| logprob over steps: {max(diffs):.2e}; "
          f"R3 coverage min {min(r.get('r3/coverage', float('nan')) for r in rows):.3f}")
    if cfg.logging.plot:
        print(f"[skyrl-mega] plot:        {plot_metrics(metrics_log.path, os.path.join(cfg.output_dir, 'plot.png'))}")
    print(f"[skyrl-mega] metrics:     {metrics_log.path}")
    print(f"[skyrl-mega] checkpoint:  {step_dir(ckpt_root, steps)}")
    if cfg.checkpoint.hf_export_at_end:
        print(f"[skyrl-mega] HF export:   {hf_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
