"""The job's shared secret on the engines' control and weight-transfer endpoints.

In:  $SKYRL_ENGINE_SECRET (one per job: `job_secret()` makes it when a server is bound beyond
     loopback, or the job script exports it to every step); requests to a vLLM server.
Out: `require_secret`, an ASGI HTTP middleware that vLLM's own `--middleware` option loads into
     the API server (ServerConfig.argv adds it for any host that is not loopback): every path
     but the open ones (rollouts: /inference/v1/generate and the OpenAI /v1 API; health,
     version, openapi, metrics) is refused (401) unless the request carries the secret in
     X-Skyrl-Secret, and refused (403) if the server has no secret at all; `client_headers()`:
     the header every control call sends (control.http_json).
"""

from __future__ import annotations

import hmac
import os
import secrets

SECRET_ENV = "SKYRL_ENGINE_SECRET"
HEADER = "X-Skyrl-Secret"
MIDDLEWARE = "skyrl_mega.rollout.engine_auth.require_secret"
OPEN_PATHS = ("/health", "/ping", "/version", "/openapi.json", "/metrics", "/inference/v1/generate",
              "/tokenize", "/detokenize")
OPEN_PREFIXES = ("/v1/",)


def job_secret() -> str:
    """This job's secret: $SKYRL_ENGINE_SECRET, created (and exported to child processes) if unset."""
    if not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = secrets.token_hex(16)
    return os.environ[SECRET_ENV]


def client_headers() -> dict[str, str]:
    secret = os.environ.get(SECRET_ENV)
    return {HEADER: secret} if secret else {}


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


async def require_secret(request, call_next):
    if is_open(request.url.path):
        return await call_next(request)
    from fastapi.responses import JSONResponse

    secret = os.environ.get(SECRET_ENV)
    if not secret:
        return JSONResponse({"error": f"{request.url.path} needs the job secret, and this server has none "
                                      f"(${SECRET_ENV} unset)"}, status_code=403)
    if not hmac.compare_digest(request.headers.get(HEADER, ""), secret):
        return JSONResponse({"error": f"{request.url.path}: missing or wrong {HEADER}"}, status_code=401)
    return await call_next(request)
