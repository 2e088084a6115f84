"""`skyrl-mega serve`: an engine for a job script, with the flags the recipe's trainer gives its own.

Before it the disaggregated sbatch script started vLLM by hand: without the skyrl_bucket
weight-transfer backend and without the recipe's engine settings."""

import json
import subprocess
import sys

import pytest

from .conftest import REPO


def _dry_run(*args):
    p = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "serve", "--dry-run", *args], capture_output=True,
                       text=True, cwd=REPO, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_serve_gives_the_recipes_engine_settings_transfer_backend_and_secret(tiny_qwen3_moe):
    argv = _dry_run("--recipe", "qwen3_moe/tiny_cpu", "--host", "10.1.2.3", "--port", "8123",
                    f"model.path={tiny_qwen3_moe}", "rollout.weight_transport=nccl", "rollout.max_model_len=512",
                    "rollout.max_num_seqs=7", "rollout.extra_args=[--max-logprobs,3]")
    assert argv[argv.index("--model") + 1] == tiny_qwen3_moe
    assert argv[argv.index("--host") + 1] == "10.1.2.3" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--max-model-len") + 1] == "512" and argv[argv.index("--max-num-seqs") + 1] == "7"
    assert "--enable-return-routed-experts" in argv  # R3 on in the recipe
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "skyrl_bucket"}
    assert argv[argv.index("--middleware") + 1] == "skyrl_mega.rollout.engine_auth.require_secret"
    assert argv[-2:] == ["--max-logprobs", "3"]


def test_serve_on_loopback_needs_no_secret(tiny_qwen3_moe):
    argv = _dry_run("--recipe", "qwen3_moe/tiny_cpu", f"model.path={tiny_qwen3_moe}")
    assert "--middleware" not in argv and argv[argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("transport, backend", [("auto", True), ("nccl", True), ("shm", False)])
def test_served_engine_takes_the_transport_that_crosses_hosts(tiny_qwen3_moe, transport, backend):
    """A served engine is for a trainer on another host, which sends by nccl when its transport is
    auto (placement.py): the engine runs the weight-transfer backend unless shm is asked for."""
    argv = _dry_run("--recipe", "qwen3_moe/tiny_cpu", f"model.path={tiny_qwen3_moe}",
                    f"rollout.weight_transport={transport}")
    assert ("--weight-transfer-config" in argv) == backend
