"""`skyrl-mega convert`: HF -> dist-ckpt at EP=2 -> HF at TP=2 is bit-exact (dist-ckpt reshards),
and for Nemotron 3 HF -> dist-ckpt at PP=2 (stages of mixed layer kinds) -> HF at TP=2 (megatron
saves the Mamba in_proj / conv1d as their parts);
conversion is strict: a dist-ckpt holding layers the target architecture lacks is an error
naming them, and nothing is written."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega import cli

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def mcore(tiny_qwen3_moe, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("convert") / "mcore")
    assert cli.main(["convert", "hf-to-mcore", tiny_qwen3_moe, out, "--nproc", "2", "parallel.ep=2"]) == 0
    return out


@pytest.fixture(scope="module")
def nemotron_mcore(tiny_nemotron3, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("convert_nemotron") / "mcore")
    assert cli.main(["convert", "hf-to-mcore", tiny_nemotron3, out, "--nproc", "2", "parallel.pp=2"]) == 0
    return out


@pytest.fixture(scope="module")
def qwen3_5_mcore(tiny_qwen3_5_moe, tmp_path_factory):
    """Saved at TP=2 (GDN in_proj / conv1d split part by part, megatron's dist-ckpt factories)."""
    out = str(tmp_path_factory.mktemp("convert_qwen3_5") / "mcore")
    assert cli.main(["convert", "hf-to-mcore", tiny_qwen3_5_moe, out, "--nproc", "2", "parallel.tp=2"]) == 0
    return out


@pytest.mark.parametrize("family, back_layout", [("qwen3_moe", "parallel.tp=2"), ("nemotron3", "parallel.tp=2"),
                                                 ("qwen3_5_moe", "parallel.pp=2")])
def test_round_trip_across_layouts(family, back_layout, request, tmp_path):
    hf = request.getfixturevalue(f"tiny_{family}")
    mcore = request.getfixturevalue({"qwen3_moe": "mcore", "nemotron3": "nemotron_mcore",
                                     "qwen3_5_moe": "qwen3_5_mcore"}[family])
    back = str(tmp_path / "hf")
    assert os.path.exists(os.path.join(mcore, "metadata.json"))
    assert cli.main(["convert", "mcore-to-hf", mcore, back, "--hf", hf, "--nproc", "2", back_layout]) == 0
    original = load_file(os.path.join(hf, "model.safetensors"))
    converted = {}
    for f in glob.glob(os.path.join(back, "*.safetensors")):
        converted.update(load_file(f))
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    for f in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert os.path.exists(os.path.join(back, f)), f
    assert not glob.glob(mcore + ".partial*") and not glob.glob(back + ".partial*")


def test_bf16_model_comes_back_bf16_and_bit_exact(tmp_path):
    """The dist-ckpt holds what the model was built with; mcore-to-hf writes each tensor in the
    reference HF checkpoint's dtype, so a bf16 model's round trip is bf16, bit for bit."""
    from skyrl_mega.models.tiny import make_tiny

    hf, mcore, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    make_tiny("qwen3_moe", hf, dtype="bfloat16")
    assert cli.main(["convert", "hf-to-mcore", hf, mcore, "--nproc", "1"]) == 0
    assert cli.main(["convert", "mcore-to-hf", mcore, back, "--hf", hf, "--nproc", "1"]) == 0
    original = load_file(os.path.join(hf, "model.safetensors"))
    converted = {}
    for f in glob.glob(os.path.join(back, "*.safetensors")):
        converted.update(load_file(f))
    assert sorted(converted) == sorted(original)
    for k, v in original.items():
        assert v.dtype == torch.bfloat16 and converted[k].dtype == v.dtype, (k, converted[k].dtype)
        assert torch.equal(converted[k], v), k


def test_dist_ckpt_with_layers_the_model_lacks(mcore, tmp_path, capsys):
    """The 4-layer checkpoint into a 3-layer architecture: layer 3's 9 tensors (qkv, proj, the
    three norms, router, the two expert weights) are left over; strict=False loaded it silently."""
    from skyrl_mega.models.tiny import make_tiny

    three = make_tiny("qwen3_moe", str(tmp_path / "three_layers"), num_hidden_layers=3)
    back = str(tmp_path / "hf")
    assert cli.main(["convert", "mcore-to-hf", mcore, back, "--hf", three]) == 2
    shown = ("decoder.layers.3.mlp.experts.experts.linear_fc1.weight, decoder.layers.3.mlp.experts.experts."
             "linear_fc2.weight, decoder.layers.3.mlp.linear_fc1.layer_norm_weight, decoder.layers.3.mlp.router."
             "weight, decoder.layers.3.self_attention.k_layernorm.weight and 4 more")
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"skyrl-mega: {mcore} does not match {three}/config.json: "
                                            f"9 tensors unexpected ({shown})"), err
    assert not glob.glob(back + "*")


def test_mcore_to_hf_needs_reference_hf_dir(tmp_path):
    with pytest.raises(SystemExit, match="needs --hf"):
        cli.main(["convert", "mcore-to-hf", str(tmp_path), str(tmp_path / "o")])


def _tensors(hf_dir: str) -> dict:
    out = {}
    for f in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family, layout, multimodal", [("nemotron3", "parallel.ep=2", False),
                                                        ("qwen3_5_moe", "parallel.ep=2", True)])
def test_carried_tensors_come_back_unchanged(family, layout, multimodal, tmp_path, capfd):
    """Checkpoints as released: a multi-token-prediction layer; Qwen3.5's multimodal layout (a
    vision tower, routed experts fused 3-D); Nemotron-3-Nano's config.json form
    (`hybrid_override_pattern` and `mtp_hybrid_override_pattern` strings, not transformers 5's
    lists). The model builds neither MTP nor vision tower: hf-to-mcore (EP=2) names them and
    leaves them out (before, the strict check refused the checkpoint: 'N tensors unexpected
    (mtp...)'); mcore-to-hf and the trainer's HF save write everything back in the source's own
    layout: every tensor of the original bit for bit, config.json byte for byte."""
    from skyrl_mega.launcher import run_torchrun
    from skyrl_mega.models.tiny import make_tiny, nemotron_released_config

    hf, mcore, back, saved = (str(tmp_path / n) for n in ("hf", "mcore", "back", "saved"))
    make_tiny(family, hf, mtp=True, multimodal=multimodal)
    if family == "nemotron3":
        nemotron_released_config(hf)
    config = open(os.path.join(hf, "config.json"), "rb").read()
    original = _tensors(hf)
    carried = sorted(n for n in original if n.startswith(("mtp.", "model.visual.")))
    assert len(carried) >= 20, carried
    assert cli.main(["convert", "hf-to-mcore", hf, mcore, "--nproc", "2", layout]) == 0
    said = "".join(capfd.readouterr())
    mtp = sum(n.startswith("mtp.") for n in carried)
    assert f"{len(carried)} tensors (" in said and f"mtp.*: {mtp}" in said and "not converted" in said, said
    assert cli.main(["convert", "mcore-to-hf", mcore, back, "--hf", hf, "--nproc", "2"]) == 0
    run_torchrun(os.path.join(os.path.dirname(__file__), "workers", "save_hf_worker.py"), 1, [hf, saved],
                 timeout=300)
    for out in (back, saved):
        converted = _tensors(out)
        assert sorted(converted) == sorted(original), sorted(set(original) ^ set(converted))[:5]
        assert all(torch.equal(converted[k], original[k]) for k in original), out
        assert open(os.path.join(out, "config.json"), "rb").read() == config, out

