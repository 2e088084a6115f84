"""torchrun worker: the fast layer spec vs the local spec, same weights, same packed RL batch, R3 on.

Run: torchrun --nproc-per-node N tests/workers/fast_spec_worker.py OUT_DIR model.path=... [overrides]
Builds the policy twice from the HF checkpoint (model.spec=local, then model.spec=fast), replays
the same random valid routes in both, and writes OUT_DIR/fast_spec.json (rank 0): the module
classes each build has in its experts / core-attention / self-attention / MoE / dispatcher slots,
how many grouped GEMMs, varlen flash-attention calls, sync-free RoPE and dispatch calls each build ran, and the max |fast - local| of the logprobs, of the summed RL-loss gradients and of the
weights after one RL update (each also relative to the local value's max).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from skyrl_mega.config import load_config
from skyrl_mega.megatron import attention as attention_module
from skyrl_mega.megatron import dispatch as dispatch_module
from skyrl_mega.megatron import experts as experts_module
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron import rope as rope_module
from skyrl_mega.megatron.kernels import fused
from skyrl_mega.megatron import train_step as ts
from skyrl_mega.megatron.packing import shard_for_dp
from skyrl_mega.megatron.policy import build_policy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.train_step_worker import BASE, flat_grads  # noqa: E402

LENGTHS = (21, 9, 30, 14, 17, 26)


def random_batch(vocab: int, num_moe_layers: int, topk: int, num_experts: int) -> ts.RLBatch:
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    mask = [torch.cat([torch.zeros(4), torch.ones(n - 4)]) for n in LENGTHS]
    adv = [torch.randn(1, generator=g) for _ in LENGTHS]
    rollout = [-torch.rand(n, generator=g) * 3 for n in LENGTHS]
    # distinct valid experts per (token, MoE layer): the engine's L-1 rows
    routes = [torch.rand(n - 1, num_moe_layers, num_experts, generator=g).argsort(-1)[..., :topk].int()
              for n in LENGTHS]
    return ts.RLBatch(ids, mask, adv, rollout_logprobs=rollout, routed_experts=routes)


def slot_classes(models) -> dict:
    out = {"experts": set(), "core_attention": set(), "self_attention": set(), "mlp": set(), "token_dispatcher": set()}
    for m in models:
        for name, mod in m.named_modules():
            for slot in out:
                if name.endswith("." + slot):
                    out[slot].add(type(mod).__name__)
            if hasattr(mod, "token_dispatcher"):  # not a module: megatron keeps it as an attribute
                out["token_dispatcher"].add(type(mod.token_dispatcher).__name__)
    return {k: sorted(v) for k, v in out.items()}


def counting(fn, counter):
    def wrapped(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)
    return wrapped


def max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = torch.stack([(a - b).abs().max(), b.abs().max()]).reshape(2).float()
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only; logprobs come back on the CPU
        d = d.cuda()
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d[0].item(), d[0].item() / max(d[1].item(), 1e-30)


def main():
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, BASE + ["algorithm.use_reference=false", "algorithm.kl_coef=0.0"] + overrides)
    rank, _ = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    calls, varlen_calls, rope_calls, sorts = [0], [0], [0], [0]
    experts_module.expert_linear = counting(experts_module.expert_linear, calls)
    attention_module.varlen_causal_attention = counting(attention_module.varlen_causal_attention, varlen_calls)
    rope_module.apply_rope = counting(rope_module.apply_rope, rope_calls)
    dispatch_module.sorted_by_expert = counting(dispatch_module.sorted_by_expert, sorts)

    results, report = {}, {}
    for spec in ("local", "fast"):
        cfg.model.spec = spec
        policy = build_policy(cfg, total_steps=2)
        bridge = policy.bridge
        full = random_batch(bridge.hf_config.get_text_config().vocab_size, len(bridge.moe_layers),
                            bridge.config.moe_router_topk, bridge.config.num_moe_experts)
        batch = full.select(shard_for_dp(full.lengths, mpu.get_data_parallel_world_size(),
                                         mpu.get_data_parallel_rank()))
        par = ts.Parallelism.current(bridge.config)
        plan = ts.plan_step(batch, cfg, bridge, par, need_routes=True)
        before, before_varlen, before_rope, before_sorts = calls[0], varlen_calls[0], rope_calls[0], sorts[0]
        lps = ts.compute_logprobs(policy, batch, cfg, plan, replay=True)
        lp = torch.cat(lps) if lps is not None else torch.zeros(1)
        batch.old_logprobs = [x.detach() for x in lps] if lps is not None else [torch.zeros(n) for n in batch.lengths]
        ts.forward_backward(policy, batch, cfg, plan)
        grads = flat_grads(policy.models)
        batch.old_logprobs = None
        metrics = ts.train_step(policy, batch, cfg)
        weights = torch.cat([p.detach().float().flatten() for m in policy.models for p in m.parameters()])
        results[spec] = (lp, grads, weights)
        report[spec] = {"slots": slot_classes(policy.models), "grouped_gemms": calls[0] - before,
                        "varlen_attention_calls": varlen_calls[0] - before_varlen,
                        "packed_rope_calls": rope_calls[0] - before_rope, "device_sorts": sorts[0] - before_sorts,
                        "compiled_chains": sorted(fused.COMPILED),
                        "r3_coverage": metrics["r3/coverage"], "grad_norm": metrics["grad_norm"]}
        del policy
    for i, name in enumerate(("logprobs", "grads", "weights_after_update")):
        report[f"{name}_max_diff"], report[f"{name}_rel_diff"] = max_diff(results["fast"][i], results["local"][i])
    if rank == 0:
        with open(os.path.join(out_dir, "fast_spec.json"), "w") as f:
            json.dump(report, f, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
