"""R3 wire format: round trips, dtype choice, layer mapping, token alignment (fast, no server)."""

import base64
import io
import json

import numpy as np
import pytest

from skyrl_mega.rollout import r3_wire
from skyrl_mega.rollout.r3_wire import R3FormatError


def test_expert_dtype():
    assert r3_wire.expert_dtype(8) == np.uint8
    assert r3_wire.expert_dtype(256) == np.uint8
    assert r3_wire.expert_dtype(257) == np.int16
    assert r3_wire.expert_dtype(32768) == np.int16
    with pytest.raises(ValueError):
        r3_wire.expert_dtype(40000)
    with pytest.raises(ValueError):
        r3_wire.expert_dtype(0)


@pytest.mark.parametrize("num_experts", [8, 256, 512, 32768])
def test_encode_decode_round_trip_through_json(num_experts):
    rng = np.random.default_rng(0)
    routes = rng.integers(0, num_experts, size=(37, 3, 4))
    wire = r3_wire.encode(routes, num_experts)
    assert wire["dtype"] == ("uint8" if num_experts <= 256 else "int16")
    assert wire["shape"] == [37, 3, 4]
    back = r3_wire.decode(json.loads(json.dumps(wire)))  # survives JSON
    assert back.dtype == r3_wire.expert_dtype(num_experts)
    np.testing.assert_array_equal(back, routes)


def test_encode_rejects_out_of_range_and_bad_rank():
    with pytest.raises(R3FormatError):
        r3_wire.encode(np.array([[[8]]]), 8)
    with pytest.raises(R3FormatError):
        r3_wire.encode(np.array([[[-1]]]), 8)
    with pytest.raises(R3FormatError):
        r3_wire.encode(np.zeros((3, 2)), 8)


def test_decode_rejects_malformed():
    good = r3_wire.encode(np.zeros((2, 1, 2), dtype=np.uint8), 8)
    with pytest.raises(R3FormatError):
        r3_wire.decode({**good, "dtype": "float32"})
    with pytest.raises(R3FormatError):
        r3_wire.decode({**good, "shape": [3, 1, 2]})  # byte count mismatch
    with pytest.raises(R3FormatError):
        r3_wire.decode({**good, "data": "!!not base64!!"})
    with pytest.raises(R3FormatError):
        r3_wire.decode({"dtype": "uint8", "shape": [1, 1, 1]})
    with pytest.raises(R3FormatError):
        r3_wire.decode(42)


def test_vllm_npy_round_trip_and_no_pickle():
    routes = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(2, 4, 2) % 8
    s = r3_wire.encode_vllm(routes)
    # exactly what vLLM does (vllm.utils.serial_utils.numpy2base64)
    buf = io.BytesIO()
    np.save(buf, routes, allow_pickle=False)
    assert s == base64.b64encode(buf.getvalue()).decode()
    np.testing.assert_array_equal(r3_wire.decode_vllm(s), routes)
    np.testing.assert_array_equal(r3_wire.decode(s), routes)
    # an object array needs pickle: refused
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(R3FormatError):
        r3_wire.decode_vllm(base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(R3FormatError):
        r3_wire.decode_vllm("bm90IG5weQ==")  # "not npy"
    with pytest.raises(R3FormatError):
        r3_wire.decode_vllm(r3_wire.encode_vllm(np.zeros((3, 2), dtype=np.uint8)))  # 2-D
    with pytest.raises(R3FormatError):
        r3_wire.decode_vllm(r3_wire.encode_vllm(np.zeros((3, 2, 2), dtype=np.float32)))


def test_moe_layer_ids_from_configs():
    qwen = {"num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1, "num_local_experts": 8}
    assert r3_wire.moe_layer_ids(qwen) == [1, 2, 3]
    assert r3_wire.moe_layer_ids({**qwen, "mlp_only_layers": [], "decoder_sparse_step": 2, "num_experts": 8}) == [1, 3]
    nemotron = {"num_hidden_layers": 4, "layers_block_type": ["mamba", "moe", "attention", "moe"]}
    assert r3_wire.moe_layer_ids(nemotron) == [1, 3]
    assert r3_wire.moe_layer_ids({"hybrid_override_pattern": "M-E*E"}) == [2, 4]
    assert r3_wire.moe_layer_ids({"num_hidden_layers": 5, "first_k_dense_replace": 2}) == [2, 3, 4]
    assert r3_wire.moe_layer_ids({"text_config": {"num_hidden_layers": 3, "num_experts": 8, "decoder_sparse_step": 1}}) == [0, 1, 2]


def test_moe_layer_ids_from_hf_config_object():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[0], num_experts=8, decoder_sparse_step=1)
    assert r3_wire.moe_layer_ids(cfg) == [1, 2, 3]


def test_select_moe_layers_all_layers_reported():
    rng = np.random.default_rng(1)
    all_layers = rng.integers(0, 8, size=(10, 4, 2)).astype(np.uint8)
    all_layers[:, 0] = 0  # a dense layer: vLLM writes 0
    moe = r3_wire.select_moe_layers(all_layers, [1, 2, 3], num_hidden_layers=4)
    assert moe.shape == (10, 3, 2)
    np.testing.assert_array_equal(moe, all_layers[:, 1:])
    # inverse mapping puts them back by global layer number
    np.testing.assert_array_equal(r3_wire.expand_to_all_layers(moe, [1, 2, 3], 4), all_layers)


def test_select_moe_layers_engine_reports_moe_only():
    moe_only = np.random.default_rng(2).integers(0, 8, size=(6, 2, 2))
    out = r3_wire.select_moe_layers(moe_only, [1, 3], num_hidden_layers=4)
    np.testing.assert_array_equal(out, moe_only)
    out = r3_wire.select_moe_layers(moe_only, [1, 3])  # without num_hidden_layers too
    np.testing.assert_array_equal(out, moe_only)


def test_select_moe_layers_mismatch_is_an_error():
    with pytest.raises(R3FormatError):
        r3_wire.select_moe_layers(np.zeros((3, 3, 2)), [1, 3], num_hidden_layers=4)  # neither 4 nor 2
    with pytest.raises(R3FormatError):
        r3_wire.select_moe_layers(np.zeros((3, 3, 2)), [1, 5])  # layer 5 not reported
    with pytest.raises(ValueError):
        r3_wire.select_moe_layers(np.zeros((3, 4, 2)), [3, 1])


def test_align_to_sequence():
    prompt_len, response_len = 5, 3
    routes = np.arange((prompt_len + response_len - 1) * 2 * 2).reshape(-1, 2, 2) % 8
    aligned, valid = r3_wire.align_to_sequence(routes, prompt_len, response_len)
    assert aligned.shape == (8, 2, 2)
    np.testing.assert_array_equal(aligned[:7], routes)
    assert valid.tolist() == [True] * 7 + [False]
    full = np.zeros((8, 2, 2))
    aligned, valid = r3_wire.align_to_sequence(full, prompt_len, response_len)
    assert valid.all() and aligned.shape == (8, 2, 2)
    with pytest.raises(R3FormatError):
        r3_wire.align_to_sequence(np.zeros((5, 2, 2)), prompt_len, response_len)
