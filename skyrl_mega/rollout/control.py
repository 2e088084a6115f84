"""Control plane: the same call to EVERY vLLM server, directly (never through the router).

vllm-router forwards a control call to one backend only, so pause/resume, sleep/wake,
reset of the prefix cache, weight-version bookkeeping and collective_rpc (weight updates)
fan out from here to each server URL, concurrently, each with a timeout. A call that fails
on any server raises ControlError naming every failing server.

Endpoints (vLLM 0.30.0 with VLLM_SERVER_DEV_MODE=1, vllm/entrypoints/serve/dev/*):
    POST /pause?mode=abort|wait|keep   abort: abort in-flight requests (they finish "abort");
                                       wait: let them finish, take no new ones;
                                       keep: freeze them (KV kept), they continue on /resume.
                                       New requests queue while paused in every mode.
                                       abort/wait also clear the prefix cache.
    POST /resume, GET /is_paused
    POST /reset_prefix_cache           {"success": false} while running requests hold blocks
    POST /sleep?level=N, POST /wake_up, GET /is_sleeping   (no-ops on CPU)
        vLLM's sleep first pauses scheduling (in-flight requests aborted; from level 1 the
        prefix cache is cleared) and resumes it only once every tag is awake again: between
        /sleep and the last /wake_up no request runs (`held_by_sleep`, seen by /is_paused after
        each sleep and partial wake). A sync then needs no /pause, prefix-cache reset or
        /resume of its own.
    POST /collective_rpc {"method", "kwargs": {str: str}, "timeout"}  -> {"results": [per worker]}
    POST /update_weight_version {"new_version"}, GET /weight_info -> {"weight_version"}
        (0.30 only; where a server lacks them, as 0.26 does, the weight version is kept by the
        project's worker extension instead: collective_rpc skyrl_set_weight_version /
        skyrl_served_weight_version. EngineCaps, engine_caps.py, says which.)
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from .engine_auth import client_headers
from .errors import ControlError, RolloutConnectionError, RolloutHTTPError, RolloutResponseError, RolloutTimeoutError

PAUSE_MODES = ("abort", "wait", "keep")


def http_json(method: str, url: str, body: Any = None, timeout_s: float = 60.0) -> Any:
    """One JSON request; returns the decoded body (None for an empty one). Raises RolloutError."""
    data = None
    headers = client_headers()
    if body is not None:
        data = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise RolloutHTTPError(url, e.code, e.read().decode("utf-8", "replace")) from None
    except TimeoutError:
        raise RolloutTimeoutError(f"{method} {url}: no answer within {timeout_s:.0f}s") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise RolloutTimeoutError(f"{method} {url}: no answer within {timeout_s:.0f}s") from None
        raise RolloutConnectionError(f"{method} {url}: {reason}") from None
    return _decoded(method, url, raw)


def _decoded(method: str, url: str, raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise RolloutResponseError(f"{method} {url}: body is not JSON: {raw[:200]!r}") from None


class KeptAliveJson:
    """JSON POSTs to one server over one kept-alive HTTP connection: the calls of one weight
    sync, a few milliseconds apart, skip a TCP connect and urllib's set-up each. A connection
    idle for `idle_s` or more is replaced before it is used again (servers close idle ones:
    uvicorn after 5 s), so no request goes out on a connection the server may be closing. The
    same errors as http_json; after any error the connection is dropped. A call made while
    another is in flight (an abort's finish beside a blocked receive) goes on a connection of
    its own."""

    def __init__(self, base_url: str, idle_s: float = 1.0):
        u = urllib.parse.urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"KeptAliveJson needs an http://host:port URL, got {base_url!r}")
        self.base = base_url.rstrip("/")
        self.host, self.port, self.idle_s = u.hostname, u.port or 80, idle_s
        self._conn = None
        self._last = 0.0
        self._busy = threading.Lock()

    def post(self, path: str, body: Any, timeout_s: float) -> Any:
        url = self.base + path
        if not self._busy.acquire(blocking=False):
            return http_json("POST", url, body, timeout_s)
        try:
            return self._post(url, path, body, timeout_s)
        finally:
            self._busy.release()

    def _post(self, url: str, path: str, body: Any, timeout_s: float) -> Any:
        if self._conn is not None and time.monotonic() - self._last >= self.idle_s:
            self.close()
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        self._conn.timeout = timeout_s
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)
        headers = {**client_headers(), "content-type": "application/json"}
        data = json.dumps(body).encode()
        try:
            try:
                self._conn.request("POST", path, body=data, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                # the server had closed this kept connection before the request went out (it
                # never saw it): once more on a new connection
                self.close()
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
                self._conn.request("POST", path, body=data, headers=headers)
            r = self._conn.getresponse()
            raw = r.read()
        except TimeoutError:
            self.close()
            raise RolloutTimeoutError(f"POST {url}: no answer within {timeout_s:.0f}s") from None
        except (http.client.HTTPException, OSError) as e:
            self.close()
            raise RolloutConnectionError(f"POST {url}: {e!r}") from None
        self._last = time.monotonic()
        if r.will_close or r.status >= 400:  # servers may drop a connection after an error
            self.close()
        if r.status >= 400:
            raise RolloutHTTPError(url, r.status, raw.decode("utf-8", "replace"))
        return _decoded("POST", url, raw)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class EngineControl:
    """Fan-out control calls over the servers' base URLs (not the router's)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 120.0, caps=None):
        if not urls:
            raise ValueError("EngineControl needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._caps = caps  # engine_caps.EngineCaps of the servers; asked of the first when None
        self._asleep: set[str] = set()  # tags still asleep since the last sleep (module doc)
        self._sleep_level = 0
        self._held = False  # held_by_sleep, as last seen by /is_paused

    @property
    def caps(self):
        if self._caps is None:
            from .engine_caps import served

            self._caps = served(self.urls[0])
        return self._caps

    def _all(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> dict[str, Any]:
        t = timeout_s if timeout_s is not None else self.timeout_s
        results: dict[str, Any] = {}
        errors: dict[str, Exception] = {}
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futs = {u: pool.submit(http_json, method, u + path, body, t) for u in self.urls}
            for u, f in futs.items():
                try:
                    results[u] = f.result()
                except Exception as e:  # collect every server's failure
                    errors[u] = e
        if errors:
            lines = "; ".join(f"{u}: {e}" for u, e in errors.items())
            raise ControlError(f"{method} {path} failed on {len(errors)}/{len(self.urls)} server(s): {lines}")
        return results

    # -- generation control ----------------------------------------------------------------
    def pause(self, mode: str = "keep", clear_cache: bool = True, timeout_s: float | None = None) -> None:
        """Pause every server. mode: abort | wait | keep (see module doc)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        q = urllib.parse.urlencode({"mode": mode, "clear_cache": str(clear_cache).lower()})
        self._all("POST", f"/pause?{q}", timeout_s=timeout_s)

    def resume(self) -> None:
        self._held = False  # scheduling runs again, whoever paused it
        self._all("POST", "/resume")

    def is_paused(self) -> dict[str, bool]:
        return {u: bool(r["is_paused"]) for u, r in self._all("GET", "/is_paused").items()}

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, bool]:
        q = "?reset_running_requests=true" if reset_running_requests else ""
        return {u: bool((r or {}).get("success", True)) for u, r in self._all("POST", "/reset_prefix_cache" + q).items()}

    def sleep(self, level: int = 1) -> None:
        self._held = False  # unknown until the call returned
        self._all("POST", f"/sleep?level={int(level)}")
        self._asleep, self._sleep_level = {"weights", "kv_cache"}, int(level)
        self._held = self._sleep_holds()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wakes everything, or only `tags` ("weights", "kv_cache"): weights before a sync,
        the KV cache after it, so the cache is not allocated while the trainer holds memory."""
        self._held = False
        q = ("?" + urllib.parse.urlencode([("tags", t) for t in tags])) if tags else ""
        self._all("POST", "/wake_up" + q)
        self._asleep = self._asleep - set(tags) if tags else set()
        self._held = self._sleep_holds()

    def _sleep_holds(self) -> bool:
        """Seen, not assumed: scheduling is paused on every server while a sleep of level >= 1
        (which cleared the prefix cache) is not fully woken."""
        return bool(self._asleep) and self._sleep_level >= 1 and all(self.is_paused().values())

    @property
    def held_by_sleep(self) -> bool:
        """No request can run on any server and none holds KV from before the sleep (module doc)."""
        return self._held

    def forget_sleep(self) -> None:
        """A server was restarted (it runs awake): nothing is held by a sleep any more."""
        self._asleep, self._held = set(), False

    def is_sleeping(self) -> dict[str, bool]:
        return {u: bool((r or {}).get("is_sleeping")) for u, r in self._all("GET", "/is_sleeping").items()}

    def health(self) -> dict[str, bool]:
        out = {}
        for u in self.urls:
            try:
                http_json("GET", u + "/health", timeout_s=5.0)
                out[u] = True
            except Exception:
                out[u] = False
        return out

    # -- weights ---------------------------------------------------------------------------
    def collective_rpc(self, method: str, kwargs: dict[str, str] | None = None, timeout_s: float | None = None) -> dict[str, list]:
        """Calls `method` on every worker of every server; {url: [one result per worker]}."""
        body = {"method": method, "kwargs": kwargs or {}}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        res = self._all("POST", "/collective_rpc", body, timeout_s=(timeout_s or self.timeout_s) + 10)
        out = {}
        for u, r in res.items():
            if r is None:
                out[u] = []
            elif isinstance(r, dict) and isinstance(r.get("results"), list):
                out[u] = r["results"]
            else:
                raise ControlError(f"{u}: collective_rpc {method} answered {r!r}")
        return out

    def record_finished_version(self, version: str | int) -> None:
        """After skyrl_weight_update finished `version` (the worker extension then serves it): a
        vLLM that keeps a version of its own (0.30: /update_weight_version) is told as well."""
        if self.caps.has("/update_weight_version"):
            self.set_weight_version(version)

    def set_weight_version(self, version: str | int) -> None:
        if self.caps.has("/update_weight_version"):
            self._all("POST", "/update_weight_version", {"new_version": str(version)})
        else:
            self.collective_rpc("skyrl_set_weight_version", {"version": str(version)})

    def weight_versions(self) -> dict[str, str | None]:
        if self.caps.has("/weight_info"):
            return {u: (r or {}).get("weight_version") for u, r in self._all("GET", "/weight_info").items()}
        return {u: (r[0].get("weight_version") if r else None)
                for u, r in self.collective_rpc("skyrl_served_weight_version").items()}
