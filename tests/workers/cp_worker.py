"""torchrun worker for the context-parallel tests: one packed RL batch through a CP layout.

Run: torchrun --nproc-per-node N tests/workers/cp_worker.py OUT_DIR model.path=... parallel.cp=N [overrides]
With R3 replaying random valid routes (not the live routing, so a misplaced route changes the
result) it writes OUT_DIR/cp.safetensors (rank 0): per-sample logprobs (forward only), the
summed RL-loss gradients (megatron's grad buffers: full parameters on every CP rank), the HF
export after one RL update; and OUT_DIR/cp.json: the update's metrics and the number of local
tokens each CP rank's model saw.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from skyrl_mega.config import load_config
from skyrl_mega.config.validate import layout_problems, model_problems
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron import train_step as ts
from skyrl_mega.megatron.packing import shard_for_dp
from skyrl_mega.megatron.policy import build_policy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.fast_spec_worker import LENGTHS, random_batch  # noqa: E402
from tests.workers.train_step_worker import BASE, flat_grads  # noqa: E402


def main():
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, BASE + ["algorithm.use_reference=false", "algorithm.kl_coef=0.0"] + overrides)
    # the trainer's checks only: the GPU run of this worker has no vLLM to check a rollout against
    problems = model_problems(cfg) + layout_problems(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if problems:
        raise SystemExit(f"invalid config: {problems[0]}")
    rank, _ = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    policy = build_policy(cfg, total_steps=2)
    bridge = policy.bridge
    batch = random_batch(bridge.hf_config.vocab_size, len(bridge.moe_layers), bridge.config.moe_router_topk,
                         bridge.config.num_moe_experts)
    seen = []
    policy.models[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append(int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).numel())),
                                               with_kwargs=True)
    par = ts.Parallelism.current(bridge.config)
    plan = ts.plan_step(batch, cfg, bridge, par, need_routes=True)
    lps = ts.compute_logprobs(policy, batch, cfg, plan, replay=True)
    # the update on this data-parallel rank's share of the batch (all of it without DP)
    from megatron.core import parallel_state as mpu

    mine = shard_for_dp(batch.lengths, mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())
    batch = batch.select(mine)
    batch.old_logprobs = [lps[i].detach() for i in mine]
    ts.forward_backward(policy, batch, cfg, ts.plan_step(batch, cfg, bridge, par, need_routes=True))
    grads = flat_grads(policy.models)
    # the non-expert parameters' gradients, by name (under EP a rank holds its own experts only)
    dense_grads = torch.cat([p.main_grad.detach().float().flatten() for m in policy.models
                             for n, p in sorted(m.named_parameters()) if ".experts." not in n])
    batch.old_logprobs = None
    metrics = ts.train_step(policy, batch, cfg)
    exported = {name: t.detach().float().cpu().contiguous() for name, t in bridge.export_hf(policy.models)}
    if rank == 0:
        tensors = {f"lp_{i}": lp.float().contiguous() for i, lp in enumerate(lps)}
        tensors["grads"] = grads.cpu().contiguous()
        tensors["dense_grads"] = dense_grads.cpu().contiguous()
        tensors.update({f"w.{k}": v for k, v in exported.items()})
        save_file(tensors, os.path.join(out_dir, "cp.safetensors"))
        with open(os.path.join(out_dir, "cp.json"), "w") as f:
            json.dump({"metrics": metrics, "tokens_seen": seen, "samples": len(LENGTHS)}, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
