"""Megatron vs transformers, and layouts vs world size 1, on real torchrun gloo ranks, for each
model family (Qwen3-MoE; Nemotron 3: Mamba2 + attention + MLP + MoE on the CPU kernels;
Qwen3.5-MoE: Gated DeltaNet + gated attention + MoE on the CPU kernels, packed through
PackedGatedDeltaNet on megatron-core 0.16.1).

One torchrun per family and layout runs tests/workers/parity_worker.py (logits, packed logits,
HF export, 5 LM steps, the layer spec's modules).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
LAYOUTS = {"ws1": (1, []), "tp2": (2, ["parallel.tp=2"]), "ep2": (2, ["parallel.ep=2"]),
           "pp2": (2, ["parallel.pp=2"])}
FAMILIES = ("qwen3_moe", "nemotron3", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(family, tiny HF checkpoint dir)."""
    return request.param, request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="module")
def runs(family, tmp_path_factory):
    out = {}
    for name, (nproc, extra) in LAYOUTS.items():
        d = tmp_path_factory.mktemp(f"{family[0]}_{name}")
        # adam_eps: with 1e-8, Adam turns rounding noise in near-zero gradients into lr-sized
        # steps, so final weights would differ by ~lr where losses agree to 1e-7 (Qwen3.5's tiny
        # embedding rows seen once get gradients near 1e-6 still: 1e-5 there)
        eps = "1e-5" if family[0] == "qwen3_5_moe" else "1e-6"
        run_torchrun(os.path.join(REPO, "tests/workers/parity_worker.py"), nproc,
                     [str(d), f"model.path={family[1]}", "optim.lr=1e-3", f"optim.adam_eps={eps}", *extra],
                     timeout=400, log_file=str(d / "log.txt"))
        out[name] = d
    return out


def _hf_logits(path):
    from transformers import AutoModelForCausalLM

    from tests.workers.parity_worker import fixed_batch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(fixed_batch()).logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(runs, layout, family):
    got = load_file(runs[layout] / "logits.safetensors")["logits"]
    ref = _hf_logits(family[1])
    assert got.shape == ref.shape
    assert ref.abs().max().item() > 0.5  # logits big enough for 1e-4 to mean something
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_logits_equal_unpacked(runs, layout):
    """Sequences packed in one THD row give their unpacked logits: no attention and no Mamba
    state crosses a sequence boundary."""
    from tests.workers.parity_worker import PACKED_LENGTHS

    saved = load_file(runs[layout] / "logits.safetensors")
    for i, n in enumerate(PACKED_LENGTHS):
        assert saved[f"packed{i}"].shape == saved["logits"][i, :n].shape
        assert (saved[f"packed{i}"] - saved["logits"][i, :n]).abs().max().item() < 1e-5, i


def _model_tensors(path):
    """The checkpoint's tensors the model builds, as the bridges read them (Qwen3.5's fused
    experts as their per-expert slices, the export's names): without the MTP layer (and vision
    tower) the hybrid fixtures carry (ModelBridge.carried)."""
    from bridges.nemotron_h import NemotronHBridge
    from bridges.qwen3_5_moe import Qwen3_5MoeBridge
    from skyrl_mega.checkpoint.hf_reader import HFReader

    carried = NemotronHBridge.CARRIED_PREFIXES + Qwen3_5MoeBridge.CARRIED_PREFIXES
    reader = HFReader(path)
    names = [k for k in reader.files if not k.startswith(carried)]
    return dict(zip(names, reader.read(names)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_export_round_trip_is_bit_exact(runs, layout, family):
    exported = load_file(runs[layout] / "export.safetensors")
    original = _model_tensors(family[1])
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_training_matches_world_size_one(runs, layout):
    ref = json.load(open(runs["ws1"] / "losses.json"))
    got = json.load(open(runs[layout] / "losses.json"))
    assert len(got) == len(ref) == 5
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5
    # the weights moved, and identically
    start = load_file(runs["ws1"] / "export.safetensors")
    final_ref = load_file(runs["ws1"] / "final.safetensors")
    final = load_file(runs[layout] / "final.safetensors")
    moved = max((final_ref[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4
    for k in final_ref:
        assert (final[k] - final_ref[k]).abs().max().item() < 1e-5, k


def test_score_correction_bias_is_kept_through_training(runs, family):
    """NemotronH's router bias is a buffer megatron could update (aux-loss-free balancing):
    RL keeps it as loaded, and it is exported with the weights."""
    if family[0] != "nemotron3":
        pytest.skip(f"{family[0]}'s routers have no score-correction bias")
    start = _model_tensors(family[1])
    final = load_file(runs["ws1"] / "final.safetensors")
    biases = [k for k in start if k.endswith("gate.e_score_correction_bias")]
    assert len(biases) == 2 and all(start[k].abs().max() > 0 for k in biases)
    for k in biases:
        assert torch.equal(final[k], start[k]), k


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layer_spec_modules(runs, layout, family):
    """The local spec's entries are built as modules of their own class (no class swapped after
    the build), and an R3 build's routers hold per-model replay state, none in megatron's list."""
    spec = json.load(open(runs[layout] / "spec.json"))
    assert spec["core_attention"] == ["SdpaDotProductAttention"]
    assert spec["norms"] == ["SequenceParallelRMSNorm"]
    assert spec["routers"] == ["TopKRouter"] and spec["router_replay"] == ["NoneType"]
    assert spec["r3"]["routers"] == ["R3TopKRouter"] and spec["r3"]["router_replay"] == ["R3RouterReplay"]
    assert spec["r3"]["core_attention"] == ["SdpaDotProductAttention"]
    assert spec["r3_global_instances_added"] == 0 and spec["r3_megatron_flag"] is False
    shims = {"qwen3_moe": {"mbridge.layer_spec", "transformers.rope_theta"},
             "nemotron3": {"mamba_ssm.kernel_standins"},
             "qwen3_5_moe": {"fla.kernel_standins", "megatron_core.packed_gdn", "mbridge.layer_spec"}}[family[0]]
    assert shims | {"mbridge.local_param_names", "megatron_core.cuda_stubs"} <= set(spec["applied"])
