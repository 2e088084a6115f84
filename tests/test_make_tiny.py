"""make-tiny: loadable, seeded, deterministic checkpoints with a working local tokenizer."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega import cli
from skyrl_mega.models.tiny import FAMILIES, make_tiny


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_and_runs(tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny(family, str(tmp_path / family))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("the answer is 42", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "the answer is 42"
    assert tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_same_seed_same_weights_different_seed_differs(tmp_path):
    a = load_file(os.path.join(make_tiny("qwen3_moe", str(tmp_path / "a"), seed=3), "model.safetensors"))
    b = load_file(os.path.join(make_tiny("qwen3_moe", str(tmp_path / "b"), seed=3), "model.safetensors"))
    c = load_file(os.path.join(make_tiny("qwen3_moe", str(tmp_path / "c"), seed=4), "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_qwen3_moe_has_dense_and_moe_layers(tiny_qwen3_moe):
    cfg = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))
    names = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors")).keys()
    assert cfg["mlp_only_layers"] == [0]
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names


def test_cli_make_tiny_and_unknown_family(tmp_path):
    assert cli.main(["make-tiny", "qwen3_moe", str(tmp_path / "m")]) == 0
    assert os.path.exists(tmp_path / "m" / "tokenizer.json")
    with pytest.raises(ValueError, match="unknown model family 'llama'"):
        make_tiny("llama", str(tmp_path / "x"))


@pytest.mark.parametrize("family, size, low, high", [
    ("qwen3_moe", "1b", 0.85e9, 1.15e9), ("qwen3_moe", "2b", 2.2e9, 2.7e9), ("qwen3_moe", "8b", 9.5e9, 10.3e9),
    ("qwen3_moe", "15b", 14.8e9, 15.2e9),  # the 29.9 GB weight-sync run
    ("nemotron3", "30b_a3b", 31.5e9, 31.7e9),  # the nano recipe's arithmetic: 31.6 B
    ("qwen3_5_moe", "35b_a3b", 34.6e9, 34.7e9),  # the 35b_a3b recipe's: 34.66 B
    ("qwen3_5_moe", "397b_a17b", 396e9, 397e9)])  # 397 B released, with its MTP layer and vision tower
def test_large_sizes_have_the_parameter_counts_they_claim(family, size, low, high):
    """The GPU runs' shapes, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_mega.models.tiny import FAMILIES, SIZES

    cfg = FAMILIES[family].make_config(**SIZES[(family, size)])
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert low <= n <= high
    if size == "2b":
        assert n * 2 >= 4 * (1 << 30)  # the weight-sync benchmark's "MoE of at least 4 GiB bf16"


def test_unknown_size_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no size '7b' for qwen3_moe; sizes: \\['1b', '2b', '8b', '15b', 'tiny'\\]"):
        make_tiny("qwen3_moe", str(tmp_path / "x"), size="7b")


def test_config_only_writes_the_shape_without_weights(tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "cfg"
    assert cli.main(["make-tiny", "qwen3_moe", str(out), "--size", "8b", "--config-only", "--dtype", "bfloat16"]) == 0
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    cfg = AutoConfig.from_pretrained(str(out))
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_hidden_layers) == (2048, 64, 24)
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]  # vLLM picks its model class by this
    assert os.path.exists(out / "tokenizer.json")
