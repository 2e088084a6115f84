"""The rollout error hierarchy: every failure of the rollout stack is a RolloutError.

    RolloutError
    ├── ServerStartError        a vLLM server / router did not become healthy (log tail inside)
    ├── RolloutConnectionError  the endpoint could not be reached (after retries)
    ├── RolloutTimeoutError     a request or control call ran past its deadline
    ├── RolloutHTTPError        the server answered with a non-200 status
    │   └── RolloutBadRequestError   4xx: the request itself is bad (never retried)
    ├── RolloutResponseError    200 but the body is malformed (bad JSON, missing fields, bad shapes)
    ├── ControlError            a control call (pause/resume/collective_rpc/...) failed on a server
    └── WeightSyncError         a weight update failed on at least one engine
"""

from __future__ import annotations


class RolloutError(RuntimeError):
    """Base class of every error raised by skyrl_mega.rollout."""


class ServerStartError(RolloutError):
    """A child server (vLLM or vllm-router) exited or did not become healthy in time."""


class RolloutConnectionError(RolloutError):
    """The endpoint could not be reached, also after the configured retries."""


class RolloutTimeoutError(RolloutError):
    """A request ran past its deadline."""


class RolloutHTTPError(RolloutError):
    """The server answered with a non-200 status."""

    def __init__(self, url: str, status: int | None, body: str):
        self.url = url
        self.status = status  # None: rejected on the client, before sending
        self.body = body
        if status is None:
            super().__init__(f"request to {url} rejected before sending: {body}")
        else:
            super().__init__(f"{url} answered HTTP {status}: {_clip(body)}")


class RolloutBadRequestError(RolloutHTTPError):
    """HTTP 4xx (or a request rejected before sending): the request is invalid; not retried."""


class RolloutResponseError(RolloutError):
    """The server answered 200 but the body is not what the protocol promises."""


class ControlError(RolloutError):
    """A control-plane call failed on one or more servers."""


class WeightSyncError(RolloutError):
    """A weight update failed on at least one engine (engines are left paused)."""


def _clip(text: str, n: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"
