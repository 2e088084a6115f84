"""Process management without vLLM (fast): a fake engine stands in for the API server.

Checks: parallel start + health wait, logs to a file, crash detection and restart on the
same port by the watcher, the whole process group (grandchild included) gone after stop,
start failures and timeouts raise ServerStartError with the log tail, external URLs are
only health-checked, a SIGTERMed parent leaves no children behind.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from skyrl_mega.rollout.errors import ServerStartError
from skyrl_mega.ports import free_port, free_ports
from skyrl_mega.rollout.procs import ChildProcess, group_alive, http_status
from skyrl_mega.rollout.router import RouterProcess
from skyrl_mega.rollout.servers import ServerConfig, ServerManager, core_slices

FAKE = os.path.join(os.path.dirname(__file__), "fake_engine.py")


class FakeConfig(ServerConfig):
    """ServerConfig whose command runs the fake engine instead of vLLM."""

    def argv(self, port, engine_flags=()):
        return [sys.executable, FAKE, str(port), "--grandchild"]


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def grandchild_pid(log_path, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(log_path) as f:
            lines = [l for l in f.read().splitlines() if l.startswith("grandchild ")]
        if lines:
            return int(lines[-1].split()[1])
        time.sleep(0.05)
    raise AssertionError("fake engine did not report its grandchild")


def test_free_ports_are_distinct_and_skip_excluded():
    for _ in range(200):
        a, b, c = free_ports(3)
        assert len({a, b, c}) == 3
        (d,) = free_ports(1, exclude=(a,))
        assert d != a


def test_router_gets_distinct_http_and_metrics_ports(tmp_path):
    """Two separate free_port() calls gave a router one port for both, and it could not start."""
    for _ in range(50):
        r = RouterProcess(["http://127.0.0.1:1"], log_dir=str(tmp_path))
        metrics = int(r.child.argv[r.child.argv.index("--prometheus-port") + 1])
        assert metrics != r.port
    r = RouterProcess(["http://127.0.0.1:1"], log_dir=str(tmp_path), port=free_port())
    assert int(r.child.argv[r.child.argv.index("--prometheus-port") + 1]) != r.port


def test_core_slices():
    assert core_slices(1, [0, 1]) == [None]
    assert core_slices(2, [0, 1]) == ["0", "1"]
    assert core_slices(2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert core_slices(3, [0, 1]) == ["0", "1", "0"]


def test_manager_starts_restarts_and_leaves_no_orphans(tmp_path):
    restarted = []
    sm = ServerManager(
        FakeConfig(model="fake"), num_servers=2, log_dir=str(tmp_path),
        startup_timeout_s=30, watch_interval_s=0.2,
        on_restart=lambda i, url: restarted.append((i, url)),
    )
    with sm:
        assert len(set(sm.urls)) == 2
        assert all(http_status(u + "/health") == 200 for u in sm.urls)
        s0 = sm.servers[0]
        old_pid, url0 = s0.child.pid, s0.url
        gc0 = grandchild_pid(s0.log_path)
        assert pid_alive(gc0)
        os.kill(old_pid, signal.SIGKILL)  # crash the "API server"; its grandchild lingers
        deadline = time.time() + 30
        while not restarted and time.time() < deadline:
            time.sleep(0.1)
        assert restarted == [(0, url0)], sm.events
        assert s0.child.pid != old_pid and s0.url == url0 and s0.restarts == 1
        assert http_status(url0 + "/health") == 200
        assert not pid_alive(gc0), "the crashed server's process group was not swept"
        pids = [s.child.pid for s in sm.servers]
        gcs = [grandchild_pid(s.log_path) for s in sm.servers]
        with open(s0.log_path) as f:
            assert f.read().count("===== skyrl-mega: start #") == 2
    for pid in pids + gcs:
        assert not pid_alive(pid)
    for pid in pids:
        assert not group_alive(pid)
    assert any("restarting" in e for e in sm.events)


class DyingConfig(ServerConfig):
    """The fake engine, which on SIGUSR1 stops answering /health and exits `linger` s later."""

    linger = 3.0

    def argv(self, port, engine_flags=()):
        return [sys.executable, FAKE, str(port), "--die-slowly", str(self.linger)]


def _start_dying(sm):
    s0 = sm.servers[0]
    os.kill(s0.child.pid, signal.SIGUSR1)
    deadline = time.time() + 30
    while http_status(s0.url + "/health") == 200 and time.time() < deadline:
        time.sleep(0.02)
    return s0, s0.child.pid


@pytest.mark.parametrize("linger, settle_s", [(3.0, 30.0), (1000.0, 2.0)])
def test_settle_restarts_a_server_that_is_dying_or_hung(tmp_path, linger, settle_s):
    """A call that failed because a server went away is followed by settle(): a server that no
    longer answers but whose process has not exited yet (dying) is waited for and restarted, one
    that does not answer for settle_s (hung) is killed and restarted. check() alone sees neither."""
    cfg = DyingConfig(model="fake")
    cfg.linger = linger
    with ServerManager(cfg, num_servers=2, log_dir=str(tmp_path), startup_timeout_s=30, watch=False) as sm:
        s0, old_pid = _start_dying(sm)
        assert sm.check() == []  # still running: nothing to restart yet
        assert sm.settle(settle_s) == [0], sm.events
        assert s0.child.pid != old_pid and not pid_alive(old_pid)
        assert all(http_status(u + "/health") == 200 for u in sm.urls)
        assert sm.settle(settle_s) == []  # every server answers: nothing to do


def test_manager_gives_up_after_max_restarts(tmp_path):
    sm = ServerManager(FakeConfig(model="fake"), log_dir=str(tmp_path), watch=False, max_restarts=1)
    with sm:
        os.kill(sm.servers[0].child.pid, signal.SIGKILL)
        time.sleep(0.3)
        assert sm.check() == [0]
        os.kill(sm.servers[0].child.pid, signal.SIGKILL)
        time.sleep(0.3)
        with pytest.raises(ServerStartError, match="already restarted 1 times"):
            sm.check()


class CrashingConfig(ServerConfig):
    def argv(self, port, engine_flags=()):
        return [sys.executable, "-c", "import sys; print('boom: bad model path'); sys.exit(3)"]


class HangingConfig(ServerConfig):
    def argv(self, port, engine_flags=()):
        return [sys.executable, "-c", "import time; print('loading...', flush=True); time.sleep(60)"]


def test_start_failure_is_a_clear_error_with_log_tail(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="(?s)exited with code 3.*\nboom: bad model path"):
        ServerManager(CrashingConfig(model="x"), log_dir=str(tmp_path), startup_timeout_s=30).start()
    assert time.monotonic() - t0 < 10


def test_start_timeout_is_a_clear_error_and_kills_the_server(tmp_path):
    sm = ServerManager(HangingConfig(model="x"), log_dir=str(tmp_path), startup_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="not healthy after 2s"):
        sm.start()
    assert time.monotonic() - t0 < 20
    assert not pid_alive(sm.servers[0].child.pid)


def test_external_urls_are_only_health_checked(tmp_path):
    child = ChildProcess("fake", [sys.executable, FAKE, str(port := free_port())], str(tmp_path / "f.log"))
    child.start()
    try:
        with ServerManager(external_urls=[f"http://127.0.0.1:{port}/"], startup_timeout_s=20) as sm:
            assert sm.urls == [f"http://127.0.0.1:{port}"]
            assert sm.servers[0].child is None and sm.check() == []
        assert child.alive()  # not ours to stop
    finally:
        child.stop()
    with pytest.raises(ServerStartError, match="not healthy"):
        ServerManager(external_urls=[f"http://127.0.0.1:{free_port()}"], startup_timeout_s=1).start()


def test_sigterm_to_parent_stops_children(tmp_path):
    """A parent killed with SIGTERM runs the atexit sweep: its servers die with it."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(FAKE)!r})
        from test_processes import FakeConfig
        from skyrl_mega.rollout.servers import ServerManager
        sm = ServerManager(FakeConfig(model="fake"), log_dir={str(tmp_path)!r}).start()
        print("PIDS", sm.servers[0].child.pid, flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = ""
    deadline = time.time() + 30
    while not line.startswith("PIDS") and time.time() < deadline:
        line = p.stdout.readline()
    server_pid = int(line.split()[1])
    gc = grandchild_pid(os.path.join(str(tmp_path), "vllm_server_0.log"))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) != 0
    time.sleep(0.2)
    assert not pid_alive(server_pid) and not pid_alive(gc)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("vllm_router"), reason="needs vllm-router")
def test_router_fronts_fake_engines(tmp_path):
    """vllm-router starts, proxies /inference/v1/generate, and stops (no vLLM needed)."""
    with ServerManager(FakeConfig(model="fake"), num_servers=2, log_dir=str(tmp_path), watch=False) as sm:
        with RouterProcess(sm.urls, log_dir=str(tmp_path), startup_timeout_s=60) as router:
            from skyrl_mega.rollout.client import SamplingParams, generate_sync

            gens = generate_sync(router.url, [[1, 2, 3]] * 4, SamplingParams(max_tokens=3, n=2), deadline_s=30)
            assert [len(g.samples) for g in gens] == [2] * 4
            assert gens[0].samples[1].token_ids == [2, 3, 4]
            rpid = router.child.pid
        assert not pid_alive(rpid)


def test_child_started_from_a_short_lived_thread_survives_it(tmp_path):
    """PR_SET_PDEATHSIG follows the forking thread: spawns go through a long-lived thread."""
    import threading

    child = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "s.log"))
    t = threading.Thread(target=child.start)
    t.start()
    t.join()
    time.sleep(0.5)
    try:
        assert child.alive()
    finally:
        child.stop(grace_s=2)
    assert not child.alive()
