"""Megatron distributed optimizer + LR schedule from the OptimConfig.

In: model chunks and OptimConfig. Out: (MegatronOptimizer, OptimizerParamScheduler).
"""

from __future__ import annotations

import torch


def build_optimizer(models, optim, total_steps: int, dtype: torch.dtype = torch.float32):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ..compat.megatron_core import apply_optimizer_shims, use_fused_torch_adam

    apply_optimizer_shims()  # no per-tensor device syncs in the grad norm without apex / TE
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, models, use_gloo_process_groups=False)
    use_fused_torch_adam(optimizer)  # torch's one-pass Adam kernel where megatron chose torch AdamW
    decay_steps = max(total_steps, optim.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if optim.lr_decay_style != "constant" else optim.lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
