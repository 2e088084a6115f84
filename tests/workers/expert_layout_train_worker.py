"""torchrun worker: a few RL updates from an HF checkpoint on a seeded synthetic batch, then the
trainer's HF save. Two checkpoints holding the same weights in different expert layouts must
train to the same weights (tests/test_expert_layout.py).

Run: torchrun --nproc-per-node N tests/workers/expert_layout_train_worker.py HF_DIR OUT_DIR STEPS overrides...
"""

import sys

import torch

from skyrl_mega.config import load_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron import train_step as ts
from skyrl_mega.megatron.policy import build_policy

BASE = ["optim.lr=1e-2", "optim.lr_warmup_steps=0", "train.packing=true", "train.max_tokens_per_microbatch=64",
        "algorithm.routing_replay=false", "algorithm.use_reference=false", "algorithm.off_policy=null",
        "algorithm.old_logprobs=recompute"]


def batch(step: int, vocab: int) -> ts.RLBatch:
    """Eight 16-token samples (4 prompt tokens), advantages +-1: the same on every rank and run."""
    g = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, vocab, (16,), generator=g) for _ in range(8)]
    mask = [torch.cat([torch.zeros(4), torch.ones(12)]) for _ in ids]
    adv = [torch.tensor([1.0 if i % 2 else -1.0]) for i in range(len(ids))]
    return ts.RLBatch(ids, mask, adv, rollout_logprobs=[torch.zeros(16) for _ in ids])


def main():
    hf_dir, out_dir, steps, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    cfg = load_config(None, [f"model.path={hf_dir}", *BASE, *overrides])
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    policy = build_policy(cfg, total_steps=steps)
    vocab = policy.bridge.hf_config.get_text_config().vocab_size
    for step in range(steps):
        metrics = ts.train_step(policy, batch(step, vocab), cfg)
        assert not metrics.get("skipped"), metrics
    policy.bridge.save_hf(policy.models, out_dir)
    parallel.destroy()


if __name__ == "__main__":
    main()
