"""Each CPU compatibility patch, checked on two real gloo ranks in a fresh process."""

import json
import os

import pytest

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "probe.json"
    run_torchrun(os.path.join(REPO, "tests/workers/compat_probe.py"), 2, [str(out)], timeout=180)
    return json.load(open(out))


def test_all_patches_applied_once(probe):
    assert sorted(probe["applied"]) == sorted(
        ["cuda_stubs", "te_general_gemm", "gloo_all_to_all", "rng_tracker", "cuda_to_cpu_mode"])
    assert probe["idempotent"]


@pytest.mark.parametrize("check", [
    "current_device_is_cpu", "stream_event_ok",  # cuda_stubs
    "cuda_factory_on_cpu", "dot_cuda_identity", "float_type_reported_cuda", "to_cuda_stays_cpu",  # mode
    "te_general_gemm_none",  # te_general_gemm
    "gloo_all_to_all_tensor_splits",  # gloo_all_to_all
    "fork_restores_outer_state", "fork_stream_advances", "fork_uses_tp_rank_seed",  # rng_tracker
    "tp_ranks_differ", "states_round_trip",
])
def test_patch_behaviour(probe, check):
    assert probe[check] is True, check
