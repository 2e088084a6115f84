"""launch/slurm_colocated.sbatch on a real SLURM (scripts/slurm_local.sh starts one; .ci/run does).

Skipped when no SLURM controller answers (SLURM_CONF unset or sinfo failing).
"""

import json
import os
import shutil
import subprocess
import time

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.vllm, pytest.mark.slurm]


def _slurm_up() -> bool:
    if not shutil.which("sbatch") or not os.environ.get("SLURM_CONF"):
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mixed", "alloc"))


@pytest.mark.skipif(not _slurm_up(), reason="no SLURM cluster (run scripts/slurm_local.sh start)")
def test_colocated_sbatch_runs_the_rl_loop(tiny_qwen3_moe, tmp_path):
    out = tmp_path / "run"
    job_log = tmp_path / "job.out"
    recipe = os.path.join(REPO, "recipes/qwen3_moe/tiny_cpu.yaml")
    sub = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--output={job_log}", f"--chdir={REPO}",
         os.path.join(REPO, "launch/slurm_colocated.sbatch"), recipe, f"model.path={tiny_qwen3_moe}",
         f"output_dir={out}", f"data.train_path={tmp_path / 'digits.jsonl'}", "train.steps=3",
         "logging.progress_bar=false", "logging.tensorboard=false"],
        capture_output=True, text=True, check=True, env={**os.environ, "SKYRL_REPO": REPO})
    job = sub.stdout.strip().split(";")[0]
    deadline = time.time() + 600
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", job])
        pytest.fail(f"job {job} did not finish in time; log:\n{job_log.read_text()[-3000:]}")
    text = job_log.read_text()
    assert "mean reward: first" in text, text[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["logprob_diff_max"] < 1e-3 for r in rows)
