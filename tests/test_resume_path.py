"""checkpoint.resume=<path>: resuming from another run's checkpoint (in another output dir)
continues that run exactly; a path that does not exist or does not verify is one clear line
with exit code 2, in the launching process before torchrun, and in the ranks (bare torchrun).

The training is the LM worker of test_checkpoint.py on real gloo ranks (EP=2); it resumes
through the trainer's own resume (skyrl_mega.controller.steps.resume).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from skyrl_mega.launcher import RankUserError, run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(REPO, "tests/workers/ckpt_worker.py")
RECIPE = os.path.join(REPO, "recipes/qwen3_moe/tiny_cpu.yaml")


def _run(out, mode, model, *extra):
    os.makedirs(out, exist_ok=True)
    run_torchrun(WORKER, 2, [str(out), mode, f"model.path={model}", "parallel.ep=2", "optim.lr=1e-3", *extra],
                 timeout=300, log_file=str(out / f"{mode}.log"))
    return json.load(open(out / f"losses_{mode}.json"))


@pytest.fixture(scope="module")
def full(tiny_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_path") / "a"
    return out, _run(out, "full", tiny_qwen3_moe)


def test_resume_from_another_runs_checkpoint_continues_it_exactly(full, tiny_qwen3_moe, tmp_path):
    a, reference = full
    b = tmp_path / "b"  # its own checkpoint dir holds nothing; step 4 is the newest in a
    resumed = _run(b, "resume", tiny_qwen3_moe, f"checkpoint.resume={a / 'ckpt' / 'step_000002'}")
    assert resumed["resumed_at"] == 2
    assert sorted(resumed["losses"]) == ["2", "3", "4", "5"]
    for step, loss in resumed["losses"].items():
        assert loss == reference["losses"][step], step


def _train_cli(model, out, resume):
    p = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "train", "--recipe", RECIPE, "--nproc", "2",
                        "--timeout", "1", f"model.path={model}", f"output_dir={out}", f"checkpoint.resume={resume}"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def corrupt(full, tmp_path_factory):
    """A copy of the step-2 checkpoint with one shard file overwritten in the middle."""
    path = str(tmp_path_factory.mktemp("corrupt") / "step_000002")
    shutil.copytree(full[0] / "ckpt" / "step_000002", path)
    victim = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, victim), "r+b") as f:
        f.seek(100)
        f.write(b"\x00corrupt\x00")
    return path, f"{victim} fails its checksum"


def test_missing_or_truncated_resume_path_is_one_line_before_torchrun(corrupt, tiny_qwen3_moe, tmp_path):
    """What the launcher sees without reading the checkpoint (its manifest, the file sizes) is
    one line before torchrun; flipped bytes are the ranks' checksums' job (next test)."""
    nowhere = str(tmp_path / "nowhere" / "step_000002")
    rc, out = _train_cli(tiny_qwen3_moe, tmp_path / "run", nowhere)  # --timeout 1: torchrun would time out
    assert rc == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    assert out.startswith("skyrl-mega: ") and f"checkpoint.resume='{nowhere}'" in out, out
    path = str(tmp_path / "truncated" / "step_000002")
    shutil.copytree(corrupt[0], path)
    victim = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    size = os.path.getsize(os.path.join(path, victim))
    os.truncate(os.path.join(path, victim), size - 10)
    rc, out = _train_cli(tiny_qwen3_moe, tmp_path / "run", path)
    why = f"{victim} has {size - 10} bytes, manifest says {size}"
    assert (rc, out.strip()) == (2, f"skyrl-mega: checkpoint.resume={path} is not a usable checkpoint: {why}"), out
    assert not os.path.exists(tmp_path / "run")  # nothing made for a run that did not start


def test_corrupt_resume_path_in_the_ranks_is_their_one_line(corrupt, tiny_qwen3_moe, tmp_path):
    """The trainer's ranks started without the CLI's check: every rank finds it, one reports."""
    path, why = corrupt
    log = tmp_path / "trainer.log"
    with pytest.raises(RankUserError) as e:
        run_torchrun("skyrl_mega.trainer", 2, [RECIPE, f"model.path={tiny_qwen3_moe}", f"output_dir={tmp_path / 'o'}",
                                               "parallel.ep=2", f"checkpoint.resume={path}"],
                     timeout=300, log_file=str(log))
    assert str(e.value) == f"{path} is not a usable checkpoint: {why}"
    assert "Traceback" not in open(log).read()
