import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """A tiny random-weight Qwen3-MoE HF checkpoint made by make-tiny (fp32, seeded)."""
    from skyrl_mega.models.tiny import make_tiny

    return make_tiny("qwen3_moe", str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.fixture(scope="session")
def tiny_nemotron3(tmp_path_factory):
    """A tiny random-weight Nemotron 3 (NemotronH) checkpoint: every layer kind (M E * - M E), and
    an MTP layer's tensors as released (carried, not built)."""
    from skyrl_mega.models.tiny import make_tiny

    return make_tiny("nemotron3", str(tmp_path_factory.mktemp("tiny_nemotron3")), mtp=True)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe(tmp_path_factory):
    """A tiny random-weight Qwen3.5-MoE text checkpoint: Gated DeltaNet and gated full attention
    alternating; MoE with a gated shared expert in every layer; an MTP layer's tensors as
    released (carried, not built)."""
    from skyrl_mega.models.tiny import make_tiny

    return make_tiny("qwen3_5_moe", str(tmp_path_factory.mktemp("tiny_qwen3_5_moe")), mtp=True)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
