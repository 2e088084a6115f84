"""megatron's hybrid model (Nemotron 3 shape: Mamba2 / attention / MLP / MoE) on the local spec
and the CPU kernel stand-ins, built by skyrl_mega/megatron/hybrid_model.py, at TP=1 and TP=2
(sequence parallel) on real torchrun ranks (tests/workers/hybrid_model_worker.py)."""

import json
import os

import pytest

from skyrl_mega.launcher import run_torchrun
from skyrl_mega.megatron.hybrid_model import check_pattern

from .conftest import REPO


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_model_builds_packs_and_trains_without_te(tp, tmp_path):
    out = tmp_path / "hybrid.json"
    run_torchrun(os.path.join(REPO, "tests/workers/hybrid_model_worker.py"), tp, [str(out)], timeout=300)
    r = json.loads(out.read_text())
    assert r["layers"] == ["MambaLayer", "TransformerLayer", "MLPLayer", "MoETransformerLayer"]
    names = set(r["names"])
    # the unfused local norms, megatron's own Mamba parameters, the final norm that replaced TENorm
    for n in ("decoder.layers.0.norm.weight", "decoder.layers.0.mixer.in_proj.weight", "decoder.layers.0.mixer.A_log",
              "decoder.layers.0.mixer.norm.weight", "decoder.layers.1.input_layernorm.weight",
              "decoder.layers.2.pre_mlp_layernorm.weight", "decoder.layers.3.mlp.router.weight",
              "decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "decoder.final_norm.weight"):
        assert n in names, n
    assert r["r3_router"]
    # packed sequences restart the Mamba state (and the attention) at their boundary
    assert r["packed_vs_alone_max_abs"] < 1e-5 * max(1.0, r["logit_scale"]), r
    assert r["unpacked_differs"] > 1e-3  # without the boundary the second sequence sees the first
    assert r["no_grad"] == []


def test_layer_pattern_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown symbols"):
        check_pattern("M*X", 3)
    with pytest.raises(ValueError, match="has 2 layers, the config 3"):
        check_pattern("M*", 3)
