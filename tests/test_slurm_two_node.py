"""The sbatch scripts across two SLURM nodes (scripts/slurm_two_node.sh: each slurmd in its own
network namespace and address; .ci/run starts it and exports SLURM_TWO_NODE_CONF).

Disaggregated: trainer on skyrl-n1 (10.213.0.11), `skyrl-mega serve` on skyrl-n2 (10.213.0.12),
weights through the bucketed transport (its gloo protocol) between the two addresses, which the
trainer picks itself (rollout.weight_transport=auto: the engine is on another host).
Colocated: one trainer rank and one engine per node (rendezvous from the node list).
Killing the engine ends the job with a message, a failing exit code and nothing left running.
Skipped when the two-node cluster does not answer.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.vllm, pytest.mark.slurm, pytest.mark.slow]

CONF = os.environ.get("SLURM_TWO_NODE_CONF", "/tmp/skyrl-slurm2/slurm.conf")
NODES = ("skyrl-n1", "skyrl-n2")
ADDR = {"skyrl-n1": "10.213.0.11", "skyrl-n2": "10.213.0.12"}
ENV = {**os.environ, "SLURM_CONF": CONF, "SKYRL_IFNAME": "skyrl0", "SKYRL_REPO": REPO}
RECIPE = os.path.join(REPO, "recipes/qwen3_moe/tiny_cpu.yaml")


def _two_nodes_up() -> bool:
    if not shutil.which("sbatch") or not os.path.exists(CONF):
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=ENV, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    up = [line.split()[0] for line in r.stdout.splitlines() if re.search(r" (idle|mixed|alloc)", line)]
    return r.returncode == 0 and sorted(up) == list(NODES)


skip_unless_up = pytest.mark.skipif(not _two_nodes_up(),
                                    reason="no two-node SLURM (run scripts/slurm_two_node.sh start)")


def _netns_procs(ns: str) -> list[str]:
    """Processes in a node's namespace other than its slurmd: 'pid cmdline'."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    out = []
    for pid in r.stdout.split():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if "slurmd" not in cmd.split(" ")[0]:
            out.append(f"{pid} {cmd[:160]}")
    return out


def _submit(script: str, tmp_path, overrides: list[str], env: dict | None = None) -> str:
    sub = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path / 'job.out'}", f"--chdir={REPO}",
         os.path.join(REPO, "launch", script), RECIPE, *overrides],
        capture_output=True, text=True, check=True,
        env={**ENV, "SKYRL_LOG_DIR": str(tmp_path / "logs"), **(env or {})})
    return sub.stdout.strip().split(";")[0]


def _overrides(tiny, tmp_path, steps: int) -> list[str]:
    return [f"model.path={tiny}", f"output_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'digits.jsonl'}",
            f"train.steps={steps}", "checkpoint.every_n_steps=2", "logging.progress_bar=false",
            "logging.tensorboard=false"]


def _wait_job(job: str, tmp_path, timeout_s: float = 600) -> tuple[str, int]:
    """Waits for the job to leave the queue; its (state, exit code)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=ENV)
        if not q.stdout.strip():
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", job], env=ENV)
        pytest.fail(f"job {job} did not finish in time; log:\n{_log(tmp_path)[-3000:]}")
    info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=ENV).stdout
    state = re.search(r"JobState=(\S+)", info)
    code = re.search(r"ExitCode=(\d+):", info)
    return (state.group(1) if state else "?"), (int(code.group(1)) if code else -1)


def _log(tmp_path) -> str:
    p = tmp_path / "job.out"
    return p.read_text() if p.exists() else ""


def _assert_nothing_left(deadline_s: float = 60) -> None:
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        left = {ns: _netns_procs(ns) for ns in NODES}
        if not any(left.values()):
            return
        time.sleep(1)
    pytest.fail(f"processes left in the nodes' namespaces: {left}")


def _assert_run(tmp_path, steps: int) -> None:
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["logprob_diff_max"] < 1e-3 for r in rows)
    assert (tmp_path / "run" / "checkpoints" / f"step_{steps:06d}").is_dir()


@skip_unless_up
def test_disaggregated_trainer_and_engine_on_two_nodes(tiny_qwen3_moe, tmp_path):
    job = _submit("slurm_disaggregated.sbatch", tmp_path, _overrides(tiny_qwen3_moe, tmp_path, 3))
    state, code = _wait_job(job, tmp_path)
    text = _log(tmp_path)
    assert (state, code) == ("COMPLETED", 0), text[-3000:]
    assert "mean reward: first" in text, text[-3000:]
    # the engine served on the other node's address; the trainer hosted the transfer group on its own
    assert f"engines at http://{ADDR['skyrl-n2']}:8000; weights from {ADDR['skyrl-n1']} (NcclBroadcastTransport)" \
        in text, text[-3000:]
    assert (tmp_path / "logs" / "engine-skyrl-n2.log").exists() and (tmp_path / "logs" / "trainer-skyrl-n1.log").exists()
    _assert_run(tmp_path, 3)
    _assert_nothing_left()


@skip_unless_up
def test_colocated_trainer_ranks_on_both_nodes(tiny_qwen3_moe, tmp_path):
    job = _submit("slurm_colocated.sbatch", tmp_path, _overrides(tiny_qwen3_moe, tmp_path, 2),
                  env={"NPROC_PER_NODE": "1"})
    state, code = _wait_job(job, tmp_path)
    text = _log(tmp_path)
    assert (state, code) == ("COMPLETED", 0), text[-3000:]
    assert "mean reward: first" in text, text[-3000:]
    for node in NODES:  # one trainer rank and one engine on each node
        assert (tmp_path / "logs" / f"trainer-{node}.log").exists(), os.listdir(tmp_path / "logs")
        assert (tmp_path / "logs" / f"engine-{node}.log").exists(), os.listdir(tmp_path / "logs")
    head_log = (tmp_path / "logs" / "trainer-skyrl-n1.log").read_text()
    # both engines in the run, weights to both by the transport that crosses hosts
    assert "(NcclBroadcastTransport)" in head_log and all(f"http://{a}:8000" in head_log for a in ADDR.values()), \
        head_log[-3000:]
    _assert_run(tmp_path, 2)
    _assert_nothing_left()


def _engine_pid() -> int | None:
    r = subprocess.run(["ip", "netns", "pids", "skyrl-n2"], capture_output=True, text=True)
    for pid in r.stdout.split():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode()
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd:
            return int(pid)
    return None


@skip_unless_up
def test_killed_engine_ends_the_disaggregated_job(tiny_qwen3_moe, tmp_path):
    job = _submit("slurm_disaggregated.sbatch", tmp_path,
                  _overrides(tiny_qwen3_moe, tmp_path, 200) + ["rollout.weight_transport=nccl"])
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=ENV)
        assert q.stdout.strip(), f"job ended before its first step:\n{_log(tmp_path)[-3000:]}"
        time.sleep(1)
    pid = _engine_pid()
    assert pid, f"no vLLM server in skyrl-n2: {_netns_procs('skyrl-n2')}"
    os.kill(pid, signal.SIGKILL)
    state, code = _wait_job(job, tmp_path, timeout_s=240)
    text = _log(tmp_path)
    assert state == "FAILED" and code != 0, (state, code, text[-3000:])
    assert "an engine step ended" in text and "skyrl-n2 (http://10.213.0.12:8000)" in text or \
        "an engine step ended (exit" in text, text[-3000:]
    assert "skyrl-mega serve: the vLLM server on port 8000 ended (killed by signal 9)" in \
        (tmp_path / "logs" / "engine-skyrl-n2.log").read_text()
    _assert_nothing_left()
