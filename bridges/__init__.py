"""HF <-> Megatron bridges, one small declarative module per model family.

In: an HF config (model_type). Out: a `ModelBridge` — the only object the trainer uses to build
a Megatron model from HF weights and export HF-named tensors back. mbridge does the mapping
today; moving to Megatron-Bridge would change this package, not the trainer.
"""

from __future__ import annotations

from .interface import ModelBridge, bridge_for, register_bridge  # noqa: F401
