"""Builds the trainable Megatron model from an HF checkpoint.

In: a SkyrlConfig (model path, dtype, parallel layout) after init_model_parallel.
Out: (bridge, model chunks): chunks wrapped in megatron DDP with HF weights loaded, and the
megatron config wired for training (per-token loss scaling, grad finalisation).
"""

from __future__ import annotations

import torch

from bridges import ModelBridge, bridge_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def instantiate_chunks(provider, config, wrap_with_ddp: bool, ddp_config: dict | None = None):
    """provider(pre_process, post_process, vp_stage) per virtual stage -> device -> fp16 -> DDP."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for stage in range(vpp):
        kwargs = {"vp_stage": stage} if vpp > 1 else {}
        pre = mpu.is_pipeline_first_stage(ignore_virtual=vpp == 1, **kwargs)
        post = mpu.is_pipeline_last_stage(ignore_virtual=vpp == 1, **kwargs)
        chunk = provider(pre_process=pre, post_process=post, **({"vp_stage": stage} if vpp > 1 else {}))
        for p in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    if wrap_with_ddp:
        ddp = DistributedDataParallelConfig(**(ddp_config or {}))
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        for c in chunks:
            c.broadcast_params()
    return chunks


def build_bridge(cfg, **config_overrides) -> ModelBridge:
    p = cfg.parallel
    sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
    overrides = dict(sequence_parallel=sp, calculate_per_token_loss=True)
    overrides.update(config_overrides)
    return bridge_for(cfg.model.path, dtype=DTYPES[cfg.model.dtype], spec=cfg.model.spec, **overrides)


def build_model(cfg, wrap_with_ddp: bool = True, load_weights: bool = True, bridge: ModelBridge | None = None):
    """Returns (bridge, model_chunks). DDP uses the distributed optimizer's bucket layout."""
    from megatron.core.distributed import finalize_model_grads

    from .kernels.fused import set_fusion

    set_fusion(cfg.model.fused_kernels)
    bridge = bridge or build_bridge(cfg)
    ddp_config = dict(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        average_in_collective=False,
    )
    models = bridge.build(load_weights=load_weights, wrap_with_ddp=wrap_with_ddp, ddp_config=ddp_config)
    mcfg = bridge.config
    mcfg.finalize_model_grads_func = finalize_model_grads
    if wrap_with_ddp:
        mcfg.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
    return bridge, models
