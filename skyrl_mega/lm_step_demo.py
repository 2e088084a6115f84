"""torchrun entry: a tiny Megatron MoE language-model training run (forward/backward/step).

In: recipe path + overrides (argv). Out: per-step loss on rank 0 and metrics.jsonl in
output_dir. Learns a deterministic synthetic token pattern, so the loss visibly falls.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from skyrl_mega.config import load_config
from skyrl_mega.megatron import forward, parallel
from skyrl_mega.megatron.model import build_model
from skyrl_mega.megatron.optimizer import build_optimizer


def pattern_batch(n_seq: int, seq: int, step: int) -> torch.Tensor:
    """Counting sequences mod 97 from per-sample offsets: next token = token + 1 (mod 97) + 3."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 97, (n_seq, 1), generator=g)
    return (start + torch.arange(seq)) % 97 + 3


def main(argv: list[str]) -> None:
    recipe, overrides = (argv[0] if argv and argv[0].endswith(".yaml") else None), argv[1:] if argv and argv[0].endswith(".yaml") else argv
    cfg = load_config(recipe, overrides)
    rank, _ = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    bridge, models = build_model(cfg)
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps=cfg.train.steps)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    os.makedirs(cfg.output_dir, exist_ok=True)
    log = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") if rank == 0 else None
    seq = 32
    for step in range(cfg.train.steps):
        t0 = time.time()
        batch = pattern_batch(cfg.train.global_batch_size, seq, step)
        labels = torch.roll(batch, -1, dims=1)
        mask = torch.ones_like(batch, dtype=torch.float32)
        mask[:, -1] = 0
        pos = torch.arange(seq).expand_as(batch)
        mbs = [{"input_ids": batch[i:i + 1], "position_ids": pos[i:i + 1], "labels": labels[i:i + 1],
                "loss_mask": mask[i:i + 1]} for i in range(dp_rank, batch.shape[0], dp)]
        for m in models:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward.run_microbatches(models, mbs, forward.lm_loss, forward_only=False,
                                       model_kwargs_fn=lambda mb: {"labels": mb["labels"]})
        _, grad_norm, _ = optimizer.step()
        scheduler.step(1)
        total = torch.stack(out).sum(0) if out else torch.zeros(2, device=forward.device())
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=mpu.get_pipeline_model_parallel_group())
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        loss = (total[0] / total[1]).item()
        if log:
            rec = {"step": step, "loss": loss, "grad_norm": float(grad_norm), "step_time_s": time.time() - t0}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"step {step:3d}  loss {loss:.4f}  grad_norm {float(grad_norm):.3f}  {rec['step_time_s']*1000:.0f} ms", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
