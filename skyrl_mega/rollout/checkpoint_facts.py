"""What a server's command line depends on in the HF checkpoint it serves (its config.json).

In:  a checkpoint directory. Out: whether it is a vision-language checkpoint (served text-only),
     has Gated DeltaNet layers (a GPU prefill backend choice), or has recurrent (Mamba /
     linear-attention) layers (no prefix caching without chunked prefill). A missing or
     unreadable config.json reads as an empty one.
"""

from __future__ import annotations

import json
import os

RECURRENT_LAYER_KINDS = {"mamba", "linear_attention"}


def _hf_config(model: str) -> dict:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def is_multimodal(model: str) -> bool:
    """Whether the HF checkpoint dir `model` is a vision-language checkpoint (a vision_config
    beside its text_config): RL trains and serves its text model only."""
    cfg = _hf_config(model)
    return "vision_config" in cfg and "text_config" in cfg


def has_gdn_layers(model: str) -> bool:
    """Whether the checkpoint has Gated DeltaNet layers (Qwen3.5: `layer_types` with
    'linear_attention'; NemotronH's Mamba layers are `layers_block_type` and use no GDN kernel)."""
    cfg = _hf_config(model)
    return "linear_attention" in (cfg.get("text_config", cfg).get("layer_types") or [])


def has_recurrent_layers(model: str) -> bool:
    """Whether the HF checkpoint dir `model` has Mamba / linear-attention layers (its
    config.json's layers_block_type or layer_types; False when there is no readable one)."""
    cfg = _hf_config(model)
    cfg = cfg.get("text_config", cfg)
    kinds = set(cfg.get("layers_block_type") or []) | set(cfg.get("layer_types") or [])
    return bool(kinds & RECURRENT_LAYER_KINDS)
