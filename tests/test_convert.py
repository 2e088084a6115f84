"""`skyrl-mega convert`: HF -> dist-ckpt at EP=2 -> HF at TP=2 is bit-exact (dist-ckpt reshards)."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega import cli

pytestmark = pytest.mark.multiprocess


def test_round_trip_across_layouts(tiny_qwen3_moe, tmp_path):
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    assert cli.main(["convert", "hf-to-mcore", tiny_qwen3_moe, mcore, "--nproc", "2", "parallel.ep=2"]) == 0
    assert os.path.exists(os.path.join(mcore, "metadata.json"))
    assert cli.main(["convert", "mcore-to-hf", mcore, back, "--hf", tiny_qwen3_moe, "--nproc", "2",
                     "parallel.tp=2"]) == 0
    original = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors"))
    converted = {}
    for f in glob.glob(os.path.join(back, "*.safetensors")):
        converted.update(load_file(f))
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    for f in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert os.path.exists(os.path.join(back, f)), f


def test_mcore_to_hf_needs_reference_hf_dir(tmp_path):
    with pytest.raises(SystemExit, match="needs --hf"):
        cli.main(["convert", "mcore-to-hf", str(tmp_path), str(tmp_path / "o")])
