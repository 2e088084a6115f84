"""A failure on rank 0 alone (here: its reward workers cannot load the user's reward module; a
reward that raises only costs its sample) stops every rank promptly, and every rank reports rank
0's error, instead of the other ranks waiting in a collective until the process-group timeout
(or dying on a closed gloo pair)."""

import os
import subprocess
import time

import pytest

from skyrl_mega.launcher import torchrun_cmd

from .conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.vllm, pytest.mark.slow]
RECIPE = os.path.join(REPO, "recipes/qwen3_moe/tiny_cpu.yaml")


def test_reward_workers_failing_on_rank0_stop_every_rank_with_its_message(tiny_qwen3_moe, tmp_path):
    out = tmp_path / "run"
    args = [RECIPE, f"model.path={tiny_qwen3_moe}", f"output_dir={out}", f"data.train_path={tmp_path / 'd.jsonl'}",
            "data.reward=tests.workers.worker_unloadable_reward:score", "train.steps=3", "logging.progress_bar=false",
            "logging.tensorboard=false"]
    log = tmp_path / "run.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(torchrun_cmd("skyrl_mega.trainer", 2, args), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    rc = proc.wait(timeout=900)
    text = open(log).read()
    assert rc != 0, text[-3000:]
    # rank 1 stops with rank 0's error as its one line; rank 0 reports its own, with traceback
    assert ("stopping: rank 0 failed in starting the controller: RewardWorkerError: a reward worker cannot load "
            "the rewards ['tests.workers.worker_unloadable_reward:score']: ValueError: reward module broken on purpose "
            "in the reward worker") in text, text[-4000:]
    assert text.count("Traceback") == 1 and "raise RewardWorkerError(" in text, text[-4000:]
    assert "Connection closed by peer" not in text, text[-4000:]
    assert time.monotonic() - t0 < 900


def test_user_error_on_rank0_is_one_line_from_the_cli(tiny_qwen3_moe, tmp_path):
    """A UserError raised in a step rank 0 runs alone: `skyrl-mega train` prints it as one line
    and exits 2; no rank prints a traceback."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [os.sys.executable, "-m", "skyrl_mega.cli", "train", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}",
         f"output_dir={out}", f"data.train_path={tmp_path / 'd.jsonl'}",
         "data.reward=tests.workers.raising_reward:misconfigured", "train.steps=3", "logging.progress_bar=false",
         "logging.tensorboard=false"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    assert "skyrl-mega: reward misconfigured on purpose: set REWARD_TABLE" in proc.stderr, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
