"""skyrl-mega: Megatron-centric RL post-training for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
