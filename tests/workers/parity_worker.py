"""torchrun worker for the Megatron parity tests.

Run: torchrun --nproc-per-node N tests/workers/parity_worker.py OUT_DIR model.path=... parallel.tp=...
Writes to OUT_DIR (rank 0): logits.safetensors (full-vocab logits of a fixed batch, and of
the same sequences cut to PACKED_LENGTHS and packed into one THD row),
export.safetensors (HF export of the loaded weights), losses.json (5 LM training steps),
final.safetensors (HF export after training) and spec.json (the module classes the layer spec
built, also for an R3 build, and the compat shims applied).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from skyrl_mega.config import load_config, validate_config
from skyrl_mega.megatron import forward, parallel
from skyrl_mega.megatron.model import build_bridge, build_model
from skyrl_mega.megatron.optimizer import build_optimizer
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.lm_step import lm_train_step  # noqa: E402


PACKED_LENGTHS = (16, 11, 7, 13)


def packed_logits(models, ids):
    """Full-vocab logits of ids[i, :PACKED_LENGTHS[i]] packed in one row: a list, one a sequence."""
    from megatron.core import parallel_state as mpu

    from skyrl_mega.megatron.packing import MicroBatchLayout, pad_multiple

    layout = MicroBatchLayout.build(PACKED_LENGTHS, multiple=pad_multiple(mpu.get_tensor_model_parallel_world_size()))
    mb = {"input_ids": layout.scatter([ids[i, :n] for i, n in enumerate(PACKED_LENGTHS)]),
          "position_ids": layout.position_ids()}
    out = forward.run_microbatches(
        models, [mb], lambda mb, out: forward.gather_vocab_parallel(out).detach().cpu(), forward_only=True,
        collect_non_loss_data=True, model_kwargs_fn=lambda mb: {"packed_seq_params": layout.packed_seq_params(forward.device())})
    return layout.gather(out[0]) if out else []


def fixed_batch(n_seq=4, seq=16, vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_seq, seq), generator=g)
    return ids


def spec_report(models) -> dict:
    """Class names of the modules in each spec slot (sorted sets; empty slots, IdentityOp, left
    out), and of the routers' replay state."""
    # the hybrid stack's Mamba-layer norm is `layers.N.norm`, its final one `final_norm`
    slots = {"core_attention": (".core_attention",),
             "norms": ("layernorm", "final_layernorm", "final_norm", *(f"layers.{i}.norm" for i in range(64))),
             "routers": (".router",)}
    out = {k: set() for k in [*slots, "router_replay"]}
    for model in models:
        for name, module in model.named_modules():
            for slot, suffixes in slots.items():
                if name.endswith(suffixes) and type(module).__name__ != "IdentityOp":
                    out[slot].add(type(module).__name__)
            if name.endswith(".router"):
                out["router_replay"].add(type(module.router_replay).__name__)
    return {k: sorted(v) for k, v in out.items()}


def main():
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_config(cfg, world)
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    bridge, models = build_model(cfg)
    last_stage = mpu.is_pipeline_last_stage()

    # 1) logits of a fixed batch (the whole batch on every DP rank)
    ids = fixed_batch()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mbs = [{"input_ids": ids[i : i + 1], "position_ids": pos[i : i + 1]} for i in range(ids.shape[0])]
    with torch.no_grad():
        got = forward.run_microbatches(
            models, mbs, lambda mb, out: forward.gather_vocab_parallel(out).detach().cpu(),
            forward_only=True, collect_non_loss_data=True,
        )
        packed = packed_logits(models, ids)
    if last_stage and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        save_file({"logits": torch.cat(got, 0).contiguous(),
                   **{f"packed{i}": t.contiguous() for i, t in enumerate(packed)}}, os.path.join(out_dir, "logits.tmp"))
        os.replace(os.path.join(out_dir, "logits.tmp"), os.path.join(out_dir, "logits.safetensors"))

    # 2) HF export of the freshly loaded weights
    exported = {name: t.detach().cpu().clone().contiguous() for name, t in bridge.export_hf(models)}
    if rank == 0:
        save_file(exported, os.path.join(out_dir, "export.safetensors"))

    # 3) five LM training steps on a fixed global batch, split over DP ranks
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps=5)
    losses = []
    for step in range(5):
        batch = fixed_batch(n_seq=8, seed=100 + step)
        mask = torch.ones_like(batch, dtype=torch.float32)
        mask[:, -1] = 0
        mask[step % 8, 5:] = 0  # uneven token counts across micro-batches
        loss, grad_norm = lm_train_step(models, optimizer, scheduler, batch, mask)
        losses.append({"loss": loss, "grad_norm": grad_norm})
        print(f"step {step} loss {loss:.6f} grad_norm {grad_norm:.4f}", flush=True)
    final = {name: t.detach().cpu().clone().contiguous() for name, t in bridge.export_hf(models)}
    if rank == 0:
        save_file(final, os.path.join(out_dir, "final.safetensors"))
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)

    # 4) the layer spec: this model's modules, and an R3 build's (routers keep their own replay state)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from skyrl_mega import compat

    spec = spec_report(models)
    before = len(RouterReplay.global_router_replay_instances)
    r3_bridge = build_bridge(cfg, moe_enable_routing_replay=True)
    spec["r3"] = spec_report(r3_bridge.build(load_weights=False))
    spec["r3_global_instances_added"] = len(RouterReplay.global_router_replay_instances) - before
    spec["r3_megatron_flag"] = bool(r3_bridge.config.moe_enable_routing_replay)
    spec["applied"] = compat.applied()
    if rank == 0:
        with open(os.path.join(out_dir, "spec.json"), "w") as f:
            json.dump(spec, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
