"""The ``access`` part of the configuration tree (config.py's Settings): who may use the gateway and how much
of it one key may take, and what one tenant may learn of another. Keys themselves never live here
(access.py reads them from files and env vars): Settings are shipped to Ray and rendered into manifests."""

from __future__ import annotations

from pydantic import Field

from pdserve.spec_base import FrozenSpec


class AccessSpec(FrozenSpec):
    open: bool = Field(False, description=(
        "true = anyone who reaches gateway.host may use every route with no key: a gateway bound to anything but "
        "loopback refuses to start with no API keys unless this says so (docs/security.md)"))
    per_key_max_in_flight: int = Field(512, ge=0, description=(
        "requests one API key may have running or queued at once in one gateway process; more get 429 with "
        "Retry-After (0 = no limit; with no keys configured, every client shares one)"))
    per_key_max_connections: int = Field(1024, ge=0, description=(
        "connections one API key may hold open to one gateway process; a request on a connection past it gets 429 "
        "and the connection is closed (0 = no limit)"))
    per_key_tokens_per_min: int = Field(0, ge=0, description=(
        "prompt plus completion tokens one API key may spend per minute in one gateway process (max_tokens counted "
        "when the request starts); past it 429 with Retry-After (0 = no limit)"))
    cache_salt_per_key: bool = Field(True, description=(
        "each API key's requests carry their own vLLM cache_salt, so one tenant's prefix cache never serves (or "
        "times) another's prompt; false = every key shares the prefix cache (more hits, prompts inferable)"))
    show_cached_tokens: bool = Field(False, description=(
        "relay the engines' usage.prompt_tokens_details.cached_tokens to clients: with a shared prefix cache it "
        "tells a client which prompts others sent"))
    media_url_domains: list[str] = Field(default_factory=list, description=(
        "domains whose http(s) image/audio/video URLs a request may name (the engines fetch them, from inside the "
        "cluster); a subdomain matches its domain; empty = only data: URLs"))
