"""`skyrl-mega convert` on bad inputs (the real CLI in a subprocess): one line naming the file and
the problem, exit code 2, no traceback, and no output dir or `<dst>.partial` left behind.

- known before any rank starts (checked in the launching process): a truncated safetensors
  file, a missing HF dir / config.json / weight file / indexed shard, a model family without a
  bridge, a layout that does not divide the model, a source that is not a dist-ckpt;
- known only in the ranks (convert is strict): an HF checkpoint missing a tensor that only one
  of two EP ranks loads, with a tensor no rank loads; a dist-ckpt holding layers the model lacks.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import REPO

pytestmark = pytest.mark.multiprocess


def _convert(*args):
    p = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "convert", *args], capture_output=True, text=True,
                       cwd=REPO, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode, p.stdout, p.stderr


def _assert_user_error(result, line, dst):
    rc, out, err = result
    assert "Traceback" not in out + err, out + err
    assert [ln for ln in err.splitlines() if ln.startswith("skyrl-mega:")] == [f"skyrl-mega: {line}"], err
    assert rc == 2, out + err
    assert not os.path.exists(dst) and not glob.glob(dst + ".partial*")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _truncated(model, tmp):
    d = _copy(model, tmp / "truncated")
    f = os.path.join(d, "model.safetensors")
    full = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(full // 2)
    return d, f"{f} is truncated: {full // 2} bytes, its header describes {full}; copy or download it again"


def _no_dir(model, tmp):
    d = str(tmp / "nowhere")
    return d, f"{d} does not exist (expected an HF checkpoint directory: config.json and *.safetensors)"


def _no_config(model, tmp):
    d = _copy(model, tmp / "no_config")
    os.remove(os.path.join(d, "config.json"))
    return d, f"{d}/config.json is missing: {d} is not an HF checkpoint directory"


def _no_weights(model, tmp):
    d = _copy(model, tmp / "no_weights")
    os.remove(os.path.join(d, "model.safetensors"))
    return d, f"{d} has no *.safetensors weight files"


def _missing_shard(model, tmp):
    d = _copy(model, tmp / "missing_shard")
    names = list(load_file(os.path.join(d, "model.safetensors")))
    half = len(names) // 2
    weight_map = {n: "model.safetensors" if i < half else "model-00002.safetensors" for i, n in enumerate(names)}
    json.dump({"weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    return d, f"{d}/model.safetensors.index.json names model-00002.safetensors, which is missing from {d}"


def _unknown_family(model, tmp):
    """A checkpoint of a family with no bridge (the tiny Qwen3-MoE relabelled as Mixtral)."""
    d = str(tmp / "mixtral")
    shutil.copytree(model, d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "mixtral"}, open(os.path.join(d, "config.json"), "w"))
    return d, (f"{d}/config.json: model_type 'mixtral' is not supported "
               "(no bridge; supported: nemotron_h, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe)")


@pytest.mark.parametrize("case", [_truncated, _no_dir, _no_config, _no_weights, _missing_shard, _unknown_family])
def test_bad_hf_input_is_one_line_before_any_rank(case, tiny_qwen3_moe, tmp_path):
    src, line = case(tiny_qwen3_moe, tmp_path)
    dst = str(tmp_path / "out")
    _assert_user_error(_convert("hf-to-mcore", src, dst, "--nproc", "2", "--timeout", "1"), line, dst)


def test_layout_that_does_not_divide_the_model(tiny_qwen3_moe, tmp_path):
    dst = str(tmp_path / "out")
    _assert_user_error(_convert("hf-to-mcore", tiny_qwen3_moe, dst, "--nproc", "3", "--timeout", "1", "parallel.ep=3"),
                       "invalid config: 8 experts are not divisible by parallel.ep=3", dst)


def test_mcore_source_that_is_not_a_dist_ckpt(tiny_qwen3_moe, tmp_path):
    dst = str(tmp_path / "out")
    _assert_user_error(_convert("mcore-to-hf", tiny_qwen3_moe, dst, "--hf", tiny_qwen3_moe, "--timeout", "1"),
                       f"{tiny_qwen3_moe} is not a Megatron dist-ckpt directory (no metadata.json)", dst)


def test_hf_checkpoint_with_missing_and_unexpected_tensors(tiny_qwen3_moe, tmp_path):
    """Expert 7 of layer 2 is loaded by EP rank 1 only; both ranks report the same line."""
    d = _copy(tiny_qwen3_moe, tmp_path / "mismatch")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    tensors["model.layers.2.mlp.shared_expert.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    dst = str(tmp_path / "out")
    _assert_user_error(_convert("hf-to-mcore", d, dst, "--nproc", "2", "parallel.ep=2"),
                       f"{d} does not match its config.json: 1 tensor missing "
                       "(model.layers.2.mlp.experts.7.up_proj.weight), 1 tensor unexpected "
                       "(model.layers.2.mlp.shared_expert.up_proj.weight)", dst)
