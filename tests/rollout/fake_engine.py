"""A stand-in for a vLLM server process (for fast process-management tests, no vLLM).

python fake_engine.py PORT [--grandchild]: serves GET /health, GET /version and GET /openapi.json
(as vLLM 0.30 would, listing its own paths) and POST /inference/v1/generate (a deterministic
answer in vLLM's format) on 127.0.0.1:PORT; with --grandchild it first
starts a `sleep` child, like vLLM's EngineCore/Worker, to check that the whole process
group is stopped. Writes its pid and the grandchild's pid to stdout. With --die-slowly S, a
SIGUSR1 makes it stop answering /health (503) and exit S seconds later: a server that is
dying but not yet gone, as a killed vLLM server is on a loaded machine.
"""

import os
import signal
import subprocess
import sys
import threading

from aiohttp import web

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from skyrl_mega.rollout.r3_wire import encode_vllm  # noqa: E402

import numpy as np  # noqa: E402


DYING = threading.Event()


async def health(request):
    return web.Response(status=503 if DYING.is_set() else 200, text="")


def die_slowly(seconds: float) -> None:
    def start_dying(*_):
        DYING.set()
        threading.Timer(seconds, lambda: os._exit(1)).start()

    signal.signal(signal.SIGUSR1, start_dying)


async def version(request):
    return web.json_response({"version": "0.30.0"})


async def openapi(request):
    paths = sorted({r.resource.canonical for r in request.app.router.routes()})
    return web.json_response({"paths": {p: {} for p in paths}})


async def generate(request):
    body = await request.json()
    toks = body["token_ids"]
    sp = body["sampling_params"]
    n, m = sp.get("n", 1), sp.get("max_tokens", 4)
    choices = []
    for i in range(n):
        out = [(t + i) % 512 for t in range(1, m + 1)]
        routes = np.zeros((len(toks) + m - 1, 4, 2), dtype=np.uint8)
        choices.append({
            "index": i, "token_ids": out, "finish_reason": "length",
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -1.0} for t in out]},
            "routed_experts": encode_vllm(routes),
        })
    return web.json_response({"request_id": body.get("request_id"), "choices": choices})


def main():
    port = int(sys.argv[1])
    if "--grandchild" in sys.argv:
        gc = subprocess.Popen(["sleep", "1000"])
        print(f"grandchild {gc.pid}", flush=True)
    if "--die-slowly" in sys.argv:
        die_slowly(float(sys.argv[sys.argv.index("--die-slowly") + 1]))
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/inference/v1/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
