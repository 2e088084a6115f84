"""Builds megatron's hybrid (Mamba2 / attention / MLP / MoE) language model on the local spec.

In:  a megatron TransformerConfig with the mamba_* fields, the layer pattern (one symbol a
     layer: M mamba, * attention, - MLP, E MoE), vocabulary size, pre/post process, R3.
Out: megatron's model: MambaModel (megatron-core 0.16, pattern `hybrid_override_pattern`) or
     HybridModel (0.19, pattern `hybrid_layer_pattern`; MambaModel is only a deprecated wrapper
     there), built from specs/hybrid_local.py (with `fast`, its fast modules: specs/fast.py), no position embedding (NemotronH uses none).
Where mamba_ssm / causal_conv1d are absent the kernel stand-ins are registered first
(compat/mamba_ssm.py), before megatron's Mamba modules are imported.
"""

from __future__ import annotations

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def check_pattern(pattern: str, num_layers: int) -> None:
    bad = sorted(set(pattern) - set(LAYER_SYMBOLS))
    if bad:
        raise ValueError(f"hybrid layer pattern {pattern!r}: unknown symbols {bad} (known: {''.join(LAYER_SYMBOLS)})")
    if len(pattern) != num_layers:
        raise ValueError(f"hybrid layer pattern {pattern!r} has {len(pattern)} layers, the config {num_layers}")


def build_hybrid_model(config, pattern: str, vocab_size: int, max_sequence_length: int, *,
                       pre_process: bool = True, post_process: bool = True, routing_replay: bool = False,
                       share_embeddings_and_output_weights: bool = False, vp_stage: int | None = None,
                       fast: bool = False):
    from ..compat.mamba_ssm import apply_mamba_kernel_standins

    check_pattern(pattern, config.num_layers)
    apply_mamba_kernel_standins()
    from .specs.hybrid_local import hybrid_stack_spec

    spec = hybrid_stack_spec(config, routing_replay=routing_replay)
    if fast:
        from .specs.fast import use_fast_modules

        spec = use_fast_modules(spec)
    common = dict(config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                  pre_process=pre_process, post_process=post_process, position_embedding_type="none",
                  share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # megatron-core >= 0.19
    except ImportError:
        if vp_stage is not None:
            raise ValueError("megatron-core < 0.19 builds no virtual pipeline stages for hybrid models")
        from megatron.core.models.mamba.mamba_model import MambaModel

        return MambaModel(mamba_stack_spec=spec, hybrid_override_pattern=pattern, **common)
    return HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=pattern, vp_stage=vp_stage, **common)
