"""dist-ckpt save/resume on real gloo ranks (EP=2): exact continuation, atomicity, corruption."""

import json
import os
import shutil

import pytest

from skyrl_mega.checkpoint import find_latest, list_checkpoints, verify_checkpoint
from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(REPO, "tests/workers/ckpt_worker.py")


def _run(out, mode, model):
    run_torchrun(WORKER, 2, [str(out), mode, f"model.path={model}", "parallel.ep=2", "optim.lr=1e-3"],
                 timeout=300, log_file=str(out / f"{mode}.log"))
    return json.load(open(out / f"losses_{mode}.json"))


@pytest.fixture(scope="module")
def runs(tiny_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    full = _run(out, "full", tiny_qwen3_moe)
    resumed = _run(out, "resume", tiny_qwen3_moe)
    # corrupt the newest checkpoint: the next resume must detect it and use step 2
    newest = list_checkpoints(out / "ckpt")[-1][1]
    victim = next(f for f in sorted(os.listdir(newest)) if f.endswith(".distcp"))
    with open(os.path.join(newest, victim), "r+b") as f:
        f.seek(100)
        f.write(b"\x00corrupt\x00")
    fallback = _run(out, "resume_after_corruption", tiny_qwen3_moe)
    return out, full, resumed, fallback


def test_resume_reproduces_uninterrupted_run_exactly(runs):
    _, full, resumed, _ = runs
    assert resumed["resumed_at"] == 4
    assert set(resumed["losses"]) == {"4", "5"}
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step


def test_corrupted_checkpoint_detected_and_previous_used(runs):
    out, full, _, fallback = runs
    newest = list_checkpoints(out / "ckpt")[-1][1]
    assert "fails its checksum" in verify_checkpoint(newest)
    assert fallback["resumed_at"] == 2
    for step, loss in fallback["losses"].items():
        assert loss == full["losses"][step], step


def test_partial_and_manifestless_dirs_are_skipped(runs, tmp_path):
    out = runs[0]
    root = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", root)
    older, newest = [p for _, p in list_checkpoints(root)]
    shutil.copytree(older, str(root / "step_000009.partial"))  # crash mid-save: never picked
    shutil.copytree(older, str(root / "step_000008"))
    os.remove(root / "step_000008" / "skyrl_complete.json")  # save died before its manifest
    messages = []
    assert find_latest(str(root), log=messages.append) == older  # newest is corrupted (above)
    assert any("step_000008" in m and "no completion manifest" in m for m in messages)
    assert not any(".partial" in m for m in messages)


def test_keep_last_prunes_old_complete_checkpoints(runs, tmp_path):
    from skyrl_mega.checkpoint.dist_ckpt import prune

    assert [s for s, _ in list_checkpoints(runs[0] / "ckpt")] == [2, 4]  # keep_last=2 kept both
    root = tmp_path / "ckpt"
    shutil.copytree(runs[0] / "ckpt", root)
    shutil.copytree(root / "step_000002", root / "step_000001")
    prune(str(root), keep_last=1)
    # step 4 is corrupted (above), so it is not a complete checkpoint and is left for inspection;
    # of the complete ones only the newest (step 2) survives
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]


def test_trainer_checkpoint_converts_to_the_weights_it_saved(runs, tiny_qwen3_moe, tmp_path):
    """A trainer checkpoint (model + optimizer state; conversion is strict on model tensors only)
    converts to HF tensors equal to the training run's own HF export of the same step."""
    import glob

    import torch
    from safetensors.torch import load_file

    from skyrl_mega import cli

    out = str(tmp_path / "hf")
    assert cli.main(["convert", "mcore-to-hf", str(runs[0] / "ckpt" / "step_000002"), out, "--hf", tiny_qwen3_moe,
                     "--nproc", "2", "parallel.ep=2"]) == 0

    def tensors(d):
        return {k: v for f in glob.glob(os.path.join(d, "*.safetensors")) for k, v in load_file(f).items()}

    converted, exported = tensors(out), tensors(runs[0] / "hf_step_2")
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in exported)
    initial = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors"))
    assert any(not torch.equal(converted[k], initial[k]) for k in initial)  # two steps of training
