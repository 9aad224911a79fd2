"""The exception hierarchy; ``gateway/app.py`` maps each to an HTTP status and OpenAI error.

    PdserveError
    ├── ConfigError          bad configuration file, env var or flag (names the field path)
    ├── BadRequest           client input the gateway rejects itself (4xx, OpenAI error fields)
    ├── UpstreamRejected     an engine answered 4xx before streaming: relayed to the client
    ├── NoHealthyEndpoint    no engine of a role is up (503)
    ├── LegFailed            a prefill or decode leg broke (502/504)
    ├── EngineStartFailed    an engine process exited or never became ready
    ├── DeployError          rendering or applying deployment manifests failed
    └── BenchFailed          a benchmark could not run (a helper process failed, a target never answered)
"""

from __future__ import annotations

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
    """An engine refused the request (4xx); its OpenAI error body goes back to the client as is."""

    def __init__(self, role: Role, status: int, body: bytes) -> None:
        super().__init__(f"{role.value} engine rejected the request with status {status}")
        self.role, self.status, self.body = role, status, body


class NoHealthyEndpoint(PdserveError):
    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} engine")
        self.role = role


class LegFailed(PdserveError):
    def __init__(self, role: Role, url: str, status: int | None, detail: str, *, is_timeout: bool = False) -> None:
        super().__init__(f"{role.value} leg to {url} failed (status={status}): {detail}")
        self.role, self.url, self.status, self.is_timeout = role, url, status, is_timeout


class EngineStartFailed(PdserveError):
    pass


class DeployError(PdserveError):
    pass


class BenchFailed(PdserveError):
    pass
