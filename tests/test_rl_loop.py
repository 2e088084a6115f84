"""The RL loop end to end: torchrun ranks (EP=2) + a real vLLM CPU server behind vllm-router.

- the tiny demo learns (reward last 5 >= 3x first 5 and > 0.5), logprob diff < 1e-3, R3 100%;
  so does the tiny Nemotron 3 recipe (Mamba2 + attention + MLP + MoE, 25 steps), rollout vs
  train logprobs < 1e-4;
- killing the run after a checkpoint and resuming reproduces the uninterrupted run exactly;
- killing the vLLM server mid-run: the step is retried on a restarted server and the run
  completes with the uninterrupted run's rewards and losses;
- the same with the bucketed broadcast transport (rollout.weight_transport=nccl, over gloo):
  the restarted server joins a newly formed transfer group;
- the co-located protocol (rollout.weight_transport=cuda_ipc, over /dev/shm on CPU; its rounds
  through the engine worker's own listener, rollout.worker_channel) gives the
  same run as the shm transport.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from skyrl_mega.launcher import kill_tree, run_torchrun, torchrun_cmd

from .conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.vllm]
RECIPE = os.path.join(REPO, "recipes/qwen3_moe/tiny_cpu.yaml")
NEMOTRON3_RECIPE = os.path.join(REPO, "recipes/nemotron3/tiny_cpu.yaml")
QWEN3_5_RECIPE = os.path.join(REPO, "recipes/qwen3_5_moe/tiny_cpu.yaml")
COMPARE = ("reward/mean", "loss", "pg_loss", "grad_norm", "logprob_diff_max", "entropy")


def _args(model, out, recipe=RECIPE, **over):
    base = {"model.path": model, "output_dir": str(out), "data.train_path": str(out.parent / "digits.jsonl"),
            "logging.progress_bar": "false", "logging.tensorboard": "false"}
    base.update(over)
    return [recipe] + [f"{k}={v}" for k, v in base.items()]


def _metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]


def _wait_for(pred, proc, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _start(args, log):
    return subprocess.Popen(torchrun_cmd("skyrl_mega.trainer", 2, args), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def _kill_server_after_step_2(out, proc) -> str:
    """SIGKILL the vLLM server once two steps are logged; returns its log up to then."""
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(_metrics(out)) >= 2, proc, 600, "step 2")
    log = open(out / "engine_logs" / "vllm_server_0.log").read()
    os.kill(int(re.search(r"APIServer pid=(\d+)", log).group(1)), signal.SIGKILL)
    return log


def _why(log_path) -> str:
    """A failed run's story: the project's own log lines (which attempt failed how), then the tail."""
    text = open(log_path).read()
    ours = [line for line in text.splitlines() if "[skyrl-mega]" in line]
    return "\n".join(ours[-40:]) + "\n--- log tail ---\n" + text[-3000:]


def _assert_same_run(got, reference, steps):
    assert [r["step"] for r in got] == list(range(steps))
    for a, b in zip(got, reference[:steps]):
        for key in COMPARE:
            assert a[key] == b[key], (a["step"], key)


@pytest.fixture(scope="module")
def short(tiny_qwen3_moe, tmp_path_factory):
    """Uninterrupted 6-step run, checkpoint every 3 steps."""
    root = tmp_path_factory.mktemp("rl")
    out = root / "uninterrupted"
    run_torchrun("skyrl_mega.trainer", 2, _args(tiny_qwen3_moe, out, **{"train.steps": 6,
                 "checkpoint.every_n_steps": 3}), timeout=600, log_file=str(root / "u.log"))
    return root, _metrics(out)


def test_demo_learns_with_exact_rollout_train_agreement(tiny_qwen3_moe, tmp_path):
    out = tmp_path / "demo"
    run_torchrun("skyrl_mega.trainer", 2, _args(tiny_qwen3_moe, out), timeout=900,
                 log_file=str(tmp_path / "demo.log"))
    rows = _metrics(out)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 3 * first and last > 0.5, rewards
    assert all(r["logprob_diff_max"] < 1e-3 for r in rows)
    assert all(r["r3/coverage"] == 1.0 for r in rows)
    assert (out / "plot.png").stat().st_size > 10_000
    assert "mean reward: first 5 steps" in open(tmp_path / "demo.log").read()
    assert os.path.exists(out / "hf" / "final" / "config.json")


def test_nemotron3_recipe_learns_with_r3_and_exact_rollout_train_agreement(tiny_nemotron3, tmp_path):
    out = tmp_path / "nemotron3"
    run_torchrun("skyrl_mega.trainer", 2, _args(tiny_nemotron3, out, NEMOTRON3_RECIPE, **{"train.steps": 25}),
                 timeout=900, log_file=str(tmp_path / "nemotron3.log"))
    rows = _metrics(out)
    assert len(rows) == 25
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 3 * first and last > 0.5, rewards
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows)  # fp32: vLLM CPU vs megatron on the CPU kernels
    assert all(r["r3/coverage"] == 1.0 for r in rows)  # both MoE layers replayed, every token


def test_qwen3_5_recipe_learns_with_r3(tiny_qwen3_5_moe, tmp_path):
    """Gated DeltaNet layers on packed micro-batches, a bf16 vLLM CPU engine (its GDN kernel is
    bf16-only) against fp32 megatron: the policy ratio uses recomputed logprobs (TIS corrects for
    the engine's sampling), R3 replays all four MoE layers."""
    out = tmp_path / "qwen3_5"
    run_torchrun("skyrl_mega.trainer", 2, _args(tiny_qwen3_5_moe, out, QWEN3_5_RECIPE, **{"train.steps": 25}),
                 timeout=900, log_file=str(tmp_path / "qwen3_5.log"))
    rows = _metrics(out)
    assert len(rows) == 25
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 3 * first, rewards
    assert all(r["r3/coverage"] == 1.0 for r in rows)
    assert all(r["logprob_diff_mean"] < 0.02 for r in rows)  # bf16 engine vs fp32 trainer


@pytest.mark.slow
def test_qwen3_5_released_multimodal_layout_trains_its_text_model(tiny_qwen3_5_moe, tmp_path):
    """Qwen3.5-MoE's released checkpoints are vision-language (text model under
    model.language_model.*): the loop reads its text config (layer count for the routes), the
    engine serves it text-only, R3 covers every token, the HF export keeps that layout."""
    import json

    from skyrl_mega.models.tiny import qwen3_5_multimodal_layout

    model = qwen3_5_multimodal_layout(tiny_qwen3_5_moe, str(tmp_path / "vl"))
    out = tmp_path / "qwen3_5_vl"
    run_torchrun("skyrl_mega.trainer", 2, _args(model, out, QWEN3_5_RECIPE, **{"train.steps": 3}),
                 timeout=600, log_file=str(tmp_path / "qwen3_5_vl.log"))
    rows = _metrics(out)
    assert len(rows) == 3 and all(r["r3/coverage"] == 1.0 for r in rows)
    exported = json.load(open(out / "hf" / "final" / "config.json"))
    assert "text_config" in exported and exported["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]


@pytest.mark.slow
def test_kill_after_checkpoint_then_resume_is_exact(short, tiny_qwen3_moe):
    root, reference = short
    out = root / "killed"
    args = _args(tiny_qwen3_moe, out, **{"train.steps": 6, "checkpoint.every_n_steps": 3})
    proc = _start(args, root / "killed.log")
    marker = out / "checkpoints" / "step_000003" / "skyrl_complete.json"
    _wait_for(marker.exists, proc, 600, "the step-3 checkpoint")
    kill_tree(proc.pid)  # torchrun and its ranks, as a node failure would
    proc.wait()
    # the checkpoint of step 3 exists, so the metrics of steps 0-2 are on disk (the resume starts
    # at 3; a row logged after the checkpoint was lost when the kill came first)
    assert [r["step"] for r in _metrics(out)][:3] == [0, 1, 2]
    run_torchrun("skyrl_mega.trainer", 2, args, timeout=600, log_file=str(root / "resumed.log"))
    assert "resuming from step 3" in open(root / "resumed.log").read()
    resumed = {r["step"]: r for r in _metrics(out)}
    assert sorted(resumed) == list(range(6))
    for step in (3, 4, 5):
        for key in COMPARE:
            assert resumed[step][key] == reference[step][key], (step, key)


@pytest.mark.slow
def test_vllm_server_killed_mid_run_is_restarted_and_run_completes(short, tiny_qwen3_moe):
    root, reference = short
    out = root / "server_killed"
    proc = _start(_args(tiny_qwen3_moe, out, **{"train.steps": 6}), root / "sk.log")
    _kill_server_after_step_2(out, proc)
    assert proc.wait(timeout=600) == 0, _why(root / "sk.log")
    text = open(root / "sk.log").read()
    # the kill lands in a rollout or in a weight sync; either is retried on the restarted server
    assert ("rollout failed" in text or "weight sync" in text) and "restarted servers [0]" in text
    _assert_same_run(_metrics(out), reference, 6)


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_keeps_the_last_checkpoint(tiny_qwen3_moe, tmp_path):
    import shutil

    import psutil

    from skyrl_mega.checkpoint import find_latest, verify_checkpoint

    model = str(tmp_path / "model")  # a path no other process uses: finds this run's engines
    shutil.copytree(tiny_qwen3_moe, model)
    out = tmp_path / "run"
    cli = subprocess.Popen(
        [os.sys.executable, "-m", "skyrl_mega.cli", "train", "--recipe", RECIPE,
         *_args(model, out, **{"train.steps": 50, "checkpoint.every_n_steps": 1})[1:]],
        stdout=open(tmp_path / "cli.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    marker = out / "checkpoints" / "step_000002" / "skyrl_complete.json"
    _wait_for(marker.exists, cli, 600, "the step-2 checkpoint")
    os.kill(cli.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
    cli.wait(timeout=300)  # an upper bound (engines stop in seconds; a loaded box takes longer)

    def ours():
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if model in cmd or str(out) in cmd:
                found.append(cmd[:120])
        return found

    deadline = time.time() + 60
    while ours() and time.time() < deadline:
        time.sleep(1)
    assert not ours(), ours()
    latest = find_latest(str(out / "checkpoints"))
    assert latest is not None and verify_checkpoint(latest) is None
    assert int(latest.rsplit("_", 1)[-1]) >= 2


@pytest.mark.slow
def test_bucketed_broadcast_transport_rejoins_a_restarted_server(short, tiny_qwen3_moe):
    """rollout.weight_transport=nccl on CPU: every sync runs the packed-bucket broadcast protocol
    over a gloo transfer group into the vLLM server's "skyrl_bucket" backend. A server killed
    mid-run is restarted, the trainer forms a new transfer group that it joins, and the run
    equals the uninterrupted (shm transport) run."""
    root, reference = short
    out = root / "broadcast_killed"
    proc = _start(_args(tiny_qwen3_moe, out, **{"train.steps": 6, "rollout.weight_transport": "nccl"}),
                  root / "bk.log")
    log = _kill_server_after_step_2(out, proc)
    assert "skyrl_bucket: joined the transfer group" in log
    assert proc.wait(timeout=600) == 0, _why(root / "bk.log")
    text = open(root / "bk.log").read()
    try:
        assert "restarted servers [0]" in text and "transport=nccl" in text
        # the log is appended to: the restarted server joined a transfer group too
        engine_log = open(out / "engine_logs" / "vllm_server_0.log").read()
        assert engine_log.count("skyrl_bucket: joined the transfer group") >= 2
        _assert_same_run(_metrics(out), reference, 6)
    except AssertionError as e:  # where the kill landed decides the path: show it
        raise AssertionError(f"{e}\n--- trainer log tail ---\n{text[-4000:]}") from e


@pytest.mark.slow
def test_cuda_ipc_protocol_on_cpu_matches_the_shm_transport(short, tiny_qwen3_moe):
    """rollout.weight_transport=cuda_ipc on CPU: the co-located protocol (rounds of packed
    tensors named by handle and offset, here /dev/shm files instead of CUDA IPC handles) into the
    vLLM server's "skyrl_bucket" backend gives the same run as the shm transport."""
    root, reference = short
    out = root / "ipc"
    run_torchrun("skyrl_mega.trainer", 2, _args(tiny_qwen3_moe, out, **{
        "train.steps": 3, "rollout.weight_transport": "cuda_ipc"}), timeout=600,
        log_file=str(root / "ipc.log"))
    assert "transport=cuda_ipc" in open(root / "ipc.log").read()
    got = _metrics(out)
    _assert_same_run(got, reference, 3)
    # the rounds went to the engine worker's own listener (rollout.worker_channel, on by default)
    assert all(r.get("weight_sync/via_channel") == 1.0 for r in got), [r.get("weight_sync/via_channel") for r in got]
    # the first round's way, step by step (trainer: flushed, then taken by the sending thread;
    # engine: at the worker's listener, then in the worker's call), each on its own process's clock
    for r in got:
        t = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("weight_sync/")}
        assert 0 <= t["first_round_at_s"] <= t["first_round_sending_at_s"], t
        assert 0 <= t["engine_first_got_at_s"] <= t["engine_first_in_at_s"], t
