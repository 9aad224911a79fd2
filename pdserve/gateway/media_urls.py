"""The media URLs a chat may name (access.media_url_domains). vLLM's engines fetch an http(s) image, audio or video
URL themselves, from the GPU nodes, and read file: URLs under --allowed-local-media-path (vLLM 0.32
multimodal/media/connector.py, MediaConnector.load_from_url: data: decoded, any scheme starting with "http"
fetched, redirects followed by default, VLLM_MEDIA_URL_ALLOW_REDIRECTS), so a URL is a request the cluster makes
for the client. data: URLs pass; an http(s) URL only to a listed domain or its subdomain; anything else is refused.
Pure; no I/O."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from pdserve.errors import BadRequest

# The keys under which vLLM's chat parser (renderers/chat_utils.py, MM_PARSER_MAP and the untyped forms after it)
# reads a media part's URL, as a string or as {"url": ...}; "url" anywhere in a content part besides.
MEDIA_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "input_audio", "input_image"})
# What a host may be, once lower-cased: a DNS name or an IPv4 address. Anything a parser might read differently
# from vLLM's (userinfo, backslashes, percent-escapes, IPv6 zone ids) is refused rather than interpreted.
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_URL_CHARS = re.compile(r"[\x21-\x5b\x5d-\x7e]+")  # visible ASCII but the backslash (read as / by WHATWG parsers)
_CODE = "media_url_not_allowed"


def check_media_urls(body: Mapping[str, Any], *, domains: Sequence[str]) -> None:
    """Raises BadRequest (400, ``param`` naming the part's field) for a URL in a chat content part that is not
    data:, nor http(s) to a host in ``domains`` or one of their subdomains."""
    allowed = tuple(domain.strip().lower().rstrip(".") for domain in domains)
    for param, url in _part_urls(body):
        if url[:5].lower() == "data:":
            continue
        host = _http_host(url)
        if host is None:
            raise BadRequest(f"{param}: only data: and http(s) URLs may name media", param=param, code=_CODE)
        if not any(host == domain or host.endswith("." + domain) for domain in allowed):
            listed = "no domain is listed" if not allowed else "its host is not in access.media_url_domains"
            raise BadRequest(f"{param}: the engines may not fetch this URL ({listed}); send the media as a data: URL",
                             param=param, code=_CODE)


def _part_urls(body: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """Every string under a MEDIA_KEYS key, at any depth of a chat message's content parts, by its param path."""
    for message_index, message in enumerate(body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        stack: list[tuple[str, Any, bool]] = [(f"messages.{message_index}.content.{index}", part, False)
                                              for index, part in enumerate(content)]
        while stack:
            path, value, is_media = stack.pop()
            if isinstance(value, str) and is_media:
                yield path, value
            elif isinstance(value, dict):
                stack.extend((f"{path}.{key}", item, key in MEDIA_KEYS) for key, item in value.items())
            elif isinstance(value, list):
                stack.extend((f"{path}.{index}", item, is_media) for index, item in enumerate(value))


def _http_host(url: str) -> str | None:
    """The host of an http(s) URL, lower-case and without a trailing dot; None for any other URL, or one whose
    host a parser could read in two ways."""
    if not _URL_CHARS.fullmatch(url):
        return None
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        return None
    try:
        host = parts.netloc.rpartition(":")[0] if parts.port is not None else parts.netloc
    except ValueError:  # a port that is no number, or out of range
        return None
    host = host.lower().rstrip(".")
    return host if _HOST.fullmatch(host) else None
