"""Qwen3.5-MoE specifics on a real torchrun rank (the layouts' logits / export / training parity
runs in test_megatron_parity.py for this family too): packed Gated DeltaNet restarts its state
at each sequence, the multimodal checkpoint's text model loads and exports under its own prefix,
the zero-centred norms matter, and the bridge refuses configs it would build wrong."""

import json
import os

import pytest

from skyrl_mega.launcher import run_torchrun
from skyrl_mega.models.tiny import qwen3_5_multimodal_layout

from .conftest import REPO


@pytest.fixture(scope="module")
def checks(tiny_qwen3_5_moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_checks")
    mm = qwen3_5_multimodal_layout(tiny_qwen3_5_moe, str(d / "multimodal"))
    run_torchrun(os.path.join(REPO, "tests/workers/qwen3_5_checks_worker.py"), 1,
                 [tiny_qwen3_5_moe, mm, str(d / "checks.json")], timeout=300, log_file=str(d / "log.txt"))
    return json.load(open(d / "checks.json"))


@pytest.mark.multiprocess
def test_packed_equals_unpacked_with_state_reset(checks):
    """Four sequences in one THD row give their own logits (megatron-core 0.16.1 refuses packed
    GDN; PackedGatedDeltaNet serves it); the same row as one sequence does not."""
    assert checks["packed_vs_alone"] < 1e-5
    assert checks["unreset_vs_alone_later_seqs"] > 1e-2
    assert "megatron_core.packed_gdn" in checks["applied"] and "fla.kernel_standins" in checks["applied"]


@pytest.mark.multiprocess
def test_multimodal_checkpoint_loads_and_exports_its_text_model(checks):
    assert checks["as_loaded_vs_transformers"] < 1e-4
    assert checks["multimodal_vs_text_logits"] == 0.0
    assert checks["multimodal_export_names_equal"] and checks["multimodal_export_bit_exact"]


@pytest.mark.multiprocess
def test_zero_centred_norms_matter(checks):
    assert checks["zero_centred_dropped"] > 1e-2


@pytest.mark.parametrize("change, message", [
    (dict(attention_bias=True), "no attention biases"),
    (dict(hidden_act="gelu"), "mapped for silu"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "only default RoPE"),
])
def test_configs_the_bridge_would_build_wrong_are_refused(change, message):
    from bridges.qwen3_5_moe import unsupported
    from skyrl_mega.models.tiny import FAMILIES

    assert unsupported(FAMILIES["qwen3_5_moe"].make_config()) == []
    problems = unsupported(FAMILIES["qwen3_5_moe"].make_config(**change))
    assert len(problems) == 1 and message in problems[0]
