"""Nemotron 3 (NemotronH) specifics on real torchrun ranks: the regressions peers' users hit.

The layouts' logits / export / training parity runs in test_megatron_parity.py for this family
too; here, measured on the same tiny checkpoint, that those tests would catch a dropped routed
scaling factor or a lost score-correction bias (each moves the logits far beyond 1e-4), and
that the bridge refuses configs it would build wrong.
"""

import json
import os

import pytest

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO


@pytest.fixture(scope="module")
def checks(tiny_nemotron3, tmp_path_factory):
    d = tmp_path_factory.mktemp("nemotron_checks")
    run_torchrun(os.path.join(REPO, "tests/workers/nemotron_checks_worker.py"), 1,
                 [tiny_nemotron3, str(d / "checks.json")], timeout=300, log_file=str(d / "log.txt"))
    return json.load(open(d / "checks.json"))


@pytest.mark.multiprocess
def test_routed_scaling_factor_is_applied(checks):
    assert checks["routed_scaling_factor"] == 2.5
    assert checks["as_loaded"] < 1e-4
    assert checks["scaling_dropped"] > 1e-2  # what a dropped factor would look like here


@pytest.mark.multiprocess
def test_score_correction_bias_is_loaded_and_matters(checks):
    assert checks["as_loaded"] < 1e-4
    assert checks["bias_zeroed"] > 1e-2
    assert checks["bias_zeroed_routes_changed"] > 0.1


@pytest.mark.parametrize("change, message", [
    (dict(moe_latent_size=16), "latent MoE projections are not mapped yet"),
    (dict(mlp_hidden_act="silu"), "only relu2 (squared ReLU) is mapped"),
    (dict(norm_topk_prob=False), "megatron's sigmoid router always normalises the top-k"),
    (dict(layer_norm_epsilon=1e-6), "megatron's Mamba mixer norm uses 1e-05"),
    (dict(n_group=2, topk_group=2, num_experts_per_tok=2), "they agree only when that is 2"),
])
def test_configs_the_bridge_would_build_wrong_are_refused(change, message):
    from bridges.nemotron_h import unsupported
    from skyrl_mega.models.tiny import FAMILIES

    assert unsupported(FAMILIES["nemotron3"].make_config()) == []
    problems = unsupported(FAMILIES["nemotron3"].make_config(**change))
    assert len(problems) == 1 and message in problems[0]
