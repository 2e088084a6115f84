"""Layer specs: which modules build a model family's decoder layers, chosen by `model.spec`.

In:  megatron's TransformerConfig, the model family (its HF model_type), the `model.spec`
     choice, and the build's extras (virtual pipeline stage, R3 routing replay).
Out: `layer_spec(...)`: the decoder block spec GPTModel is built from; `resolve_spec(choice)`:
     the spec a choice builds here; `spec_problem(choice)`: the config error for a choice, if any.

Choices:
  auto   te when transformer_engine imports (Qwen3-MoE), else fast with CUDA, else local
  te     megatron-core's transformer-engine modules (te.py)
  local  megatron-core's own modules with skyrl's entries: sequence-parallel RMSNorm, THD-packed
         SDPA core attention (local.py)
  fast   the local spec with grouped-GEMM experts and varlen flash attention (fast.py); same
         parameters as local, every family; on CPU its modules run the local math
The hybrid families have their own local specs: Nemotron 3's Mamba2 stack (hybrid_local.py,
built by megatron/hybrid_model.py) and Qwen3.5-MoE's Gated DeltaNet decoder on GPTModel
(gdn_local.py); no TE spec for either is wired yet, so for them `te` is a ConfigError.
Both built specs take `routing_replay=True`, which puts skyrl's R3 router in every MoE layer's
router slot (common.R3TopKRouter).
"""

from __future__ import annotations

from ...config.validate import ConfigError

CHOICES = ("auto", "te", "local", "fast")
NOT_BUILT: dict[str, str] = {}
# what the local and fast specs need in megatron's config: no grouped GEMM, megatron's own attention
LOCAL_CONFIG = dict(moe_grouped_gemm=False, attention_backend="local")
# the TE spec: experts as TE's grouped GEMM (TEGroupedMLP, the parameter names mbridge maps)
TE_CONFIG = dict(moe_grouped_gemm=True)
# model family (HF model_type) -> the block builder kind its layers use
FAMILIES = {"qwen3_moe": "gpt", "nemotron_h": "hybrid", "qwen3_5_moe_text": "gdn", "qwen3_5_moe": "gdn"}
# the spec choices each kind has built
BUILT = {"gpt": ("te", "local", "fast"), "hybrid": ("local", "fast"), "gdn": ("local", "fast")}


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def spec_problem(choice: str) -> str | None:
    """The one-line config error for a `model.spec` value, or None when it can be built."""
    if choice in NOT_BUILT:
        return f"model.spec={choice!r}: {NOT_BUILT[choice]}; use model.spec=auto, te or local"
    if choice not in CHOICES:
        return f"model.spec={choice!r} is not one of {[c for c in CHOICES if c not in NOT_BUILT]}"
    return None


def resolve_spec(choice: str = "auto", family: str | None = None) -> str:
    """'te', 'fast' or 'local' for a `model.spec` choice (and model family, when known); ConfigError for
    a choice that cannot be built here."""
    problem = spec_problem(choice)
    if problem:
        raise ConfigError(problem)
    built = BUILT[FAMILIES.get(family, "gpt")]
    if choice == "auto":
        if te_available() and "te" in built:
            return "te"
        return "fast" if cuda_available() else "local"
    if choice not in built:
        raise ConfigError(f"model.spec={choice!r}: no {choice} layer spec is built for {family} yet; "
                          f"use model.spec=local")
    if choice == "te" and not te_available():
        raise ConfigError("model.spec='te' but transformer_engine does not import here; "
                          "install transformer-engine or use model.spec=local")
    return choice


def layer_spec(config, family: str, spec: str = "auto", *, vp_stage: int | None = None,
               routing_replay: bool = False):
    """The decoder block spec of `family` for megatron `config`, built by the `spec` choice."""
    kind = resolve_spec(spec, family)
    if family not in FAMILIES:
        raise ConfigError(f"no layer spec for model family {family!r}; families: {sorted(FAMILIES)}")
    if FAMILIES[family] == "gdn":
        from .gdn_local import decoder_block_spec
    elif kind == "te":
        from .te import decoder_block_spec
    else:
        from .local import decoder_block_spec
    block = decoder_block_spec(config, vp_stage=vp_stage, routing_replay=routing_replay)
    if kind == "fast":
        from .fast import use_fast_modules

        block = use_fast_modules(block)
    return block
