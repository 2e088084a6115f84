"""torchrun worker: several updates per rollout batch (megatron/train_step.train_on_batch) against
plain train steps, each from freshly built weights of the same HF checkpoint.

Run: torchrun --nproc-per-node N tests/workers/minibatch_worker.py HF_DIR OUT_JSON overrides...
Writes (rank 0) OUT_JSON: the largest |weight difference| of
  one_vs_step       train_on_batch, 1 mini-batch, 1 epoch   vs train_step on the batch
  two_vs_sequential train_on_batch, 2 mini-batches          vs train_step on each half, in order
  moved             the trained weights vs the loaded ones (training did something)
  epochs            2 mini-batches x 2 epochs vs 1 epoch (the second pass trains on)
and the updates each run reported.
"""

import json
import sys

import torch

from skyrl_mega.config import load_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron import train_step as ts
from skyrl_mega.megatron.packing import mini_batches, shard_for_dp
from skyrl_mega.megatron.policy import build_policy

BASE = ["optim.lr=1e-2", "optim.lr_warmup_steps=0", "train.packing=true", "train.max_tokens_per_microbatch=64",
        "algorithm.routing_replay=false", "algorithm.use_reference=false", "algorithm.old_logprobs=rollout",
        "+algorithm.policy_loss_kwargs.eps_low=0.2"]


def global_batch(vocab: int) -> ts.RLBatch:
    g = torch.Generator().manual_seed(7)
    lens = [12, 16, 9, 14, 16, 11, 13, 10]
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    mask = [torch.cat([torch.zeros(4), torch.ones(n - 4)]) for n in lens]
    adv = [torch.tensor([1.0 if i % 3 else -1.0]) for i in range(len(lens))]
    rollout = [-2.5 + 0.3 * torch.randn(n, generator=g) for n in lens]
    return ts.RLBatch(ids, mask, adv, rollout_logprobs=rollout)


def mine(batch: ts.RLBatch) -> ts.RLBatch:
    from megatron.core import parallel_state as mpu

    return batch.select(shard_for_dp(batch.lengths, mpu.get_data_parallel_world_size(),
                                     mpu.get_data_parallel_rank()))


def weights(policy) -> dict:
    return {n: t.detach().float().cpu().clone() for n, t in policy.bridge.export_hf(policy.models)}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    hf_dir, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(None, [f"model.path={hf_dir}", *BASE, *overrides])
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)

    def run(mode: str, epochs: int = 1):
        cfg.train.epochs = epochs
        policy = build_policy(cfg, total_steps=10)
        batch = global_batch(policy.bridge.hf_config.get_text_config().vocab_size)
        start = weights(policy) if mode == "step" else None
        if mode == "step":
            metrics = [ts.train_step(policy, mine(batch), cfg)]
        elif mode == "sequential":
            metrics = [ts.train_step(policy, mine(half), cfg) for half in mini_batches(batch, 2)]
        else:
            metrics = [ts.train_on_batch(policy, [mine(m) for m in mini_batches(batch, int(mode))], cfg)]
        metrics[-1]["scheduler_steps"] = policy.step
        return weights(policy), start, metrics

    step, start, _ = run("step")
    one, _, m_one = run("1")
    seq, _, _ = run("sequential")
    two, _, m_two = run("2")
    two_epochs, _, m_epochs = run("2", epochs=2)
    res = {"one_vs_step": max_diff(one, step), "two_vs_sequential": max_diff(two, seq), "moved": max_diff(step, start),
           "epochs": max_diff(two_epochs, two), "one_vs_two": max_diff(one, two),
           "updates": [m_one[0]["updates"], m_two[0]["updates"], m_epochs[0]["updates"]],
           "schedule_steps": [m_one[0]["scheduler_steps"], m_two[0]["scheduler_steps"], m_epochs[0]["scheduler_steps"]],
           "clipfrac_first_last": [m_epochs[0]["pg_clipfrac/first_update"], m_epochs[0]["pg_clipfrac/last_update"]]}
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    print(json.dumps(res), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
