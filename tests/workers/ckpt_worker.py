"""torchrun worker: LM training with checkpoints after steps 2 and 4; `resume*` continues from
the latest complete one.

Run: torchrun --nproc-per-node 2 tests/workers/ckpt_worker.py OUT_DIR {full|resume*} overrides...
Rank 0 writes OUT_DIR/losses_<mode>.json (step -> loss) and, on resume, the step it resumed at.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from skyrl_mega.checkpoint import find_latest, load_checkpoint, save_checkpoint
from skyrl_mega.config import load_config
from skyrl_mega.lm_step_demo import pattern_batch
from skyrl_mega.megatron import forward, parallel
from skyrl_mega.megatron.model import build_model
from skyrl_mega.megatron.optimizer import build_optimizer

STEPS, SAVE_AT = 6, (2, 4)


def main():
    out_dir, mode, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(None, overrides)
    rank, _ = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    _, models = build_model(cfg)
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps=STEPS)
    root = os.path.join(out_dir, "ckpt")
    start = 0
    if mode.startswith("resume"):
        state = load_checkpoint(find_latest(root), models, optimizer, scheduler)
        start = state["step"]
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = {}
    for step in range(start, STEPS):
        batch = pattern_batch(4, 16, step) + (torch.rand(4, 16) < 0.3).long()  # consumes torch RNG
        labels = torch.roll(batch, -1, 1)
        mask = torch.ones(batch.shape)
        mask[:, -1] = 0
        pos = torch.arange(16).expand_as(batch)
        mbs = [{"input_ids": batch[i:i + 1], "position_ids": pos[i:i + 1], "labels": labels[i:i + 1],
                "loss_mask": mask[i:i + 1]} for i in range(dp_rank, 4, dp)]
        for m in models:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward.run_microbatches(models, mbs, forward.lm_loss, False,
                                       model_kwargs_fn=lambda mb: {"labels": mb["labels"]})
        optimizer.step()
        scheduler.step(1)
        total = torch.stack(out).sum(0) if out else torch.zeros(2)
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses[step] = (total[0] / total[1]).item()
        if mode == "full" and step + 1 in SAVE_AT:
            save_checkpoint(root, step + 1, models, optimizer, scheduler, {"note": "test"}, keep_last=2)
    if rank == 0:
        json.dump({"resumed_at": start, "losses": losses}, open(os.path.join(out_dir, f"losses_{mode}.json"), "w"))
    parallel.destroy()


if __name__ == "__main__":
    main()
