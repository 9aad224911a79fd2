"""The exception hierarchy; ``gateway/client_errors.py`` maps each to an HTTP status and OpenAI error.

    PdserveError
    ├── ConfigError          bad configuration file, env var or flag (names the field path)
    ├── BadRequest           client input the gateway rejects itself (4xx, OpenAI error fields)
    ├── UpstreamRejected     an engine answered 4xx before streaming: its message relayed to the client
    ├── NoHealthyEndpoint    no engine of a role is up (503)
    ├── NotReady             the gateway has not yet sent a request through both legs (503)
    ├── Overloaded           no slot for the request and no room or time left to wait for one (429)
    ├── RateLimited          one API key past its own limits: requests in flight or tokens per minute (429)
    ├── LegFailed            a prefill or decode leg broke (502/504)
    ├── EngineStartFailed    an engine process exited or never became ready
    ├── DeployError          rendering or applying deployment manifests failed
    ├── GatewayUnavailable   a command could not ask the running gateway (none answers, no admin key)
    └── BenchFailed          a benchmark could not run (a helper process failed, a target never answered)
"""

from __future__ import annotations

from enum import StrEnum

from pdserve.role import Role


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError):
    pass


class BadRequest(PdserveError):
    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


class UpstreamRejected(PdserveError):
    """An engine refused the request (4xx); its message goes back to the client, its address cut out."""

    def __init__(self, role: Role, url: str, status: int, body: bytes) -> None:
        super().__init__(f"{role.value} engine {url} rejected the request with status {status}")
        self.role, self.url, self.status, self.body = role, url, status, body


class NoHealthyEndpoint(PdserveError):
    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} engine")
        self.role = role


class NotReady(PdserveError):
    def __init__(self) -> None:
        super().__init__("pdserve is not ready yet: engines are starting or warming up")


class OverloadReason(StrEnum):
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"


class Overloaded(PdserveError):
    """Refused for load (gateway/admission.py); ``retry_after_s`` is the client's suggested wait."""

    def __init__(self, reason: OverloadReason, *, retry_after_s: int) -> None:
        what = "too many requests are waiting" if reason is OverloadReason.QUEUE_FULL else "no slot freed in time"
        super().__init__(f"pdserve is overloaded ({what}); retry after {retry_after_s} s")
        self.reason, self.retry_after_s = reason, retry_after_s


class RateLimited(PdserveError):
    """One tenant past its per-key limits (gateway/key_limits.py); ``kind``: what ran out, as OpenAI's error type
    names it ("requests" or "tokens"); ``retry_after_s``: when that frees."""

    def __init__(self, message: str, *, kind: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.kind, self.retry_after_s = kind, retry_after_s


class LegFailed(PdserveError):
    def __init__(self, role: Role, url: str, status: int | None, detail: str, *, is_timeout: bool = False) -> None:
        super().__init__(f"{role.value} leg to {url} failed (status={status}): {detail}")
        self.role, self.url, self.status, self.is_timeout = role, url, status, is_timeout


class EngineStartFailed(PdserveError):
    pass


class DeployError(PdserveError):
    pass


class GatewayUnavailable(PdserveError):
    """``status``, ``scale`` or ``verify`` could not ask the gateway, or it would not answer; says what to do."""


class BenchFailed(PdserveError):
    pass
