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


def test_keep_last_prunes_old_complete_checkpoints_without_reading_them(runs, tmp_path, monkeypatch):
    from skyrl_mega.checkpoint import dist_ckpt

    assert [s for s, _ in list_checkpoints(runs[0] / "ckpt")] == [2, 4]  # keep_last=2 kept both
    root = tmp_path / "ckpt"
    shutil.copytree(runs[0] / "ckpt", root)
    shutil.copytree(root / "step_000002", root / "step_000001")
    shutil.copytree(root / "step_000002", root / "step_000003")
    os.remove(root / "step_000003" / "skyrl_complete.json")  # incomplete: never pruned, never counted

    def no_reading(path):
        raise AssertionError(f"prune read {path}")

    monkeypatch.setattr(dist_ckpt, "_crc32", no_reading)
    dist_ckpt.prune(str(root), keep_last=1)
    # complete = manifest present and every file of its size (step 4's flipped bytes are found
    # by the checksums at load, not here); of steps 1, 2, 4 only the newest stays
    assert [s for s, _ in list_checkpoints(root)] == [3, 4]


def test_each_rank_checksums_its_own_shards_and_load_splits_the_checksums(runs):
    from skyrl_mega.checkpoint import dist_ckpt

    older = list_checkpoints(runs[0] / "ckpt")[0][1]
    files = json.load(open(os.path.join(older, "skyrl_complete.json")))["files"]
    writers = {dist_ckpt._writer(rel) for rel in files}
    assert writers == {0, 1}  # both ranks' shards (and RNG files) were listed by their writers
    assert {"rng/rank_00000.safetensors", "rng/rank_00001.safetensors"} <= set(files)
    shares = [dist_ckpt._checksum_share(files, k, 2) for k in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files)  # every file checked once
    sizes = [sum(files[r]["bytes"] for r in share) for share in shares]
    assert max(sizes) - min(sizes) <= max(f["bytes"] for f in files.values())  # balanced by bytes


def test_convert_of_a_corrupted_trainer_checkpoint_is_one_line_from_the_ranks(runs, tiny_qwen3_moe, tmp_path):
    """The launcher reads no checkpoint bytes (sizes only); the ranks split the checksums."""
    from tests.test_convert_errors import _assert_user_error, _convert

    newest = list_checkpoints(runs[0] / "ckpt")[-1][1]
    victim = next(f for f in sorted(os.listdir(newest)) if f.endswith(".distcp"))  # corrupted above
    dst = str(tmp_path / "out")
    _assert_user_error(_convert("mcore-to-hf", newest, dst, "--hf", tiny_qwen3_moe, "--nproc", "2", "parallel.ep=2"),
                       f"{newest} is not a usable checkpoint: {victim} fails its checksum", dst)
