"""What keeps tenants (access.py's AccessKeys.tenant) apart on shared engines: each request's vLLM ``cache_salt``, so
one tenant's prefix cache never serves, nor times, another's prompt; X-PD-Mode for the admin only; the engines'
``cached_tokens`` kept from clients. Pure; no I/O."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from pdserve.access import Access, AccessKeys
from pdserve.errors import BadRequest
from pdserve.gateway.request_input import parse_mode
from pdserve.protocol import PD_MODE_HEADER
from pdserve.routing.decision import Mode

# vLLM salts the first block's hash with ``cache_salt`` and every later block's hash chains from it (vLLM 0.32
# v1/core/kv_cache_utils.py, generate_block_hash_extra_keys), so requests of two salts share no cached block. 43
# base64url characters (256 bits) as vLLM's field description asks; its validator takes at most 128 characters,
# none of "@/\\" or NUL (entrypoints/generate/base/protocol.py, validate_cache_salt).
SALT_CHARS = 43
_DETAILS = re.compile(rb'([{,]\s*"prompt_tokens_details"\s*:\s*)\{[^{}]*\}')


class CacheSalts:
    """The ``cache_salt`` of each tenant's requests: an HMAC of the tenant (and of the salt the client chose within
    it) under a secret digested from every configured key. Every gateway process and replica given the same keys
    derives the same salts, so a tenant's requests share one prefix cache wherever they land; nobody without
    every key can derive another tenant's salt, even with an engine's own port in reach."""

    def __init__(self, keys: AccessKeys) -> None:
        material = b"\0".join([b"pdserve cache_salt", *sorted(keys.api_keys), keys.admin_key or b""])
        self._secret = hashlib.sha256(material).digest()

    def salt(self, tenant: str, *, chosen: str | None = None) -> str:
        """The salt of ``tenant``'s requests; ``chosen``: the client's own cache_salt, which parts its tenant's
        cache further (one per end user, say) and never reaches another tenant's."""
        message = tenant.encode() + b"\0" + (chosen or "").encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode("ascii")[:SALT_CHARS]


def requested_mode(header: bytes | None, *, access: Access) -> Mode | None:
    """The client's X-PD-Mode, which only the admin may send once keys are configured (with none, everyone is
    the admin): the mode decides which engine computes the prompt, so a client choosing it could aim timing probes
    at one engine's prefix cache, or have the decode engines compute its prompts. Raises BadRequest: 403 for anyone else (refused, not ignored, so that a benchmark
    comparing the modes never measures the wrong one), 400 for a malformed value."""
    mode = parse_mode(header)
    if mode is not None and access < Access.ADMIN:
        raise BadRequest(f"{PD_MODE_HEADER} is for the admin key only", status=403, param=PD_MODE_HEADER,
                         code="permission_denied")
    return mode


def hide_cached_tokens(data: bytes) -> bytes:
    """``data`` (a whole reply, or SSE events) with each usage's ``prompt_tokens_details`` null, as an engine run
    without --enable-prompt-tokens-details writes it: its ``cached_tokens`` would tell a client which prompts others
    sent. JSON text only ever holds the field's name quoted after ``{`` or ``,`` where it is a key (a string's own
    quotes are escaped), so no generated text is touched."""
    if b'"prompt_tokens_details"' not in data:
        return data
    return _DETAILS.sub(rb"\1null", data)
