"""torchrun worker: LM training with checkpoints after steps 2 and 4 (and an HF export of the
step-2 weights); `resume*` continues from the checkpoint the trainer's resume picks
(checkpoint.resume: auto = the latest complete one in OUT_DIR/ckpt, or an explicit path).

Run: torchrun --nproc-per-node 2 tests/workers/ckpt_worker.py OUT_DIR {full|resume*} overrides...
Rank 0 writes OUT_DIR/losses_<mode>.json (step -> loss) and, on resume, the step it resumed at.
"""

import json
import os
import sys

import torch

from skyrl_mega.checkpoint import save_checkpoint
from skyrl_mega.config import load_config
from skyrl_mega.controller.steps import resume
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron.model import build_model
from skyrl_mega.megatron.optimizer import build_optimizer
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.lm_step import lm_train_step, pattern_batch  # noqa: E402

STEPS, SAVE_AT = 6, (2, 4)


def main():
    out_dir, mode, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(None, overrides)
    rank, _ = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    bridge, models = build_model(cfg)
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps=STEPS)
    root = os.path.join(out_dir, "ckpt")
    start = 0
    if mode.startswith("resume"):
        start, _ = resume(cfg, root, models, optimizer, scheduler)
    losses = {}
    for step in range(start, STEPS):
        batch = pattern_batch(4, 16, step) + (torch.rand(4, 16) < 0.3).long()  # consumes torch RNG
        mask = torch.ones(batch.shape)
        mask[:, -1] = 0
        losses[step], _ = lm_train_step(models, optimizer, scheduler, batch, mask)
        if mode == "full" and step + 1 in SAVE_AT:
            save_checkpoint(root, step + 1, models, optimizer, scheduler, {"note": "test"}, keep_last=2)
            if step + 1 == SAVE_AT[0]:
                bridge.save_hf(models, os.path.join(out_dir, f"hf_step_{step + 1}"))
    if rank == 0:
        json.dump({"resumed_at": start, "losses": losses}, open(os.path.join(out_dir, f"losses_{mode}.json"), "w"))
    parallel.destroy()


if __name__ == "__main__":
    main()
