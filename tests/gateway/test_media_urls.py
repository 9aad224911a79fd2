"""Media URLs in chat content parts (access.media_url_domains): data: passes, http(s) only to a listed domain or its
subdomain, anything else (file:, other schemes, hosts a parser could read two ways) gets a 400 naming the part."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.errors import BadRequest
from pdserve.gateway.media_urls import check_media_urls
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post, ready_gateway_over

DOMAINS = ["media.example.com", "CDN.Example.org."]
PNG = "data:image/png;base64,iVBORw0KGgo="


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 5,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "see http://169.254.169.254/"}, *parts]}]}


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("part", [
    image(PNG), image("DATA:image/png;base64,iVBORw0KGgo="),
    image("https://media.example.com/cat.png"), image("http://a.b.media.example.com:8080/cat%20big.png?x=@y"),
    {"type": "video_url", "video_url": {"url": "https://cdn.example.org/clip.mp4"}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},  # data, not a URL
])
def test_data_urls_and_listed_domains_pass(part: dict[str, Any]) -> None:
    check_media_urls(chat(part), domains=DOMAINS)


@pytest.mark.parametrize(("part", "param"), [
    (image("http://169.254.169.254/latest/meta-data/"), "messages.1.content.1.image_url.url"),
    (image("https://example.com.evil.net/x.png"), "messages.1.content.1.image_url.url"),
    (image("https://notmedia.example.com/x.png"), "messages.1.content.1.image_url.url"),
    (image("file:///etc/passwd"), "messages.1.content.1.image_url.url"),
    (image("ftp://media.example.com/x.png"), "messages.1.content.1.image_url.url"),
    (image("httpx://media.example.com/x.png"), "messages.1.content.1.image_url.url"),  # vLLM fetches any "http*"
    (image("https://evil.net\\@media.example.com/"), "messages.1.content.1.image_url.url"),
    (image("https://media.example.com:443@evil.net/"), "messages.1.content.1.image_url.url"),
    (image("https://[::1]/x.png"), "messages.1.content.1.image_url.url"),
    (image("//media.example.com/x.png"), "messages.1.content.1.image_url.url"),
    ({"image_url": "http://10.0.0.1/x.png"}, "messages.1.content.1.image_url"),  # vLLM's untyped part
    ({"type": "audio_url", "audio_url": {"url": "http://10.0.0.1/a.wav"}}, "messages.1.content.1.audio_url.url"),
    ({"type": "video_url", "video_url": {"url": "http://10.0.0.1/v.mp4"}}, "messages.1.content.1.video_url.url"),
    ({"type": "input_audio", "input_audio": "http://10.0.0.1/a.wav"}, "messages.1.content.1.input_audio"),
    ({"type": "custom", "source": {"url": "http://10.0.0.1/"}}, "messages.1.content.1.source.url"),
])
def test_other_urls_are_refused_naming_the_part(part: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_media_urls(chat(part), domains=DOMAINS)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.code == "media_url_not_allowed"


def test_with_no_domain_listed_only_data_urls_pass() -> None:
    check_media_urls(chat(image(PNG)), domains=[])
    with pytest.raises(BadRequest):
        check_media_urls(chat(image("https://media.example.com/cat.png")), domains=[])


async def test_the_gateway_refuses_a_media_url_before_any_engine_sees_it() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake, access={"media_url_domains": ["media.example.com"]}) as base:
        fake.bodies.clear()
        status, payload = await post(base, chat(image("http://169.254.169.254/latest/meta-data/")),
                                     path="/v1/chat/completions")
        allowed, _ = await post(base, chat(image("https://media.example.com/cat.png")), path="/v1/chat/completions")
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "messages.1.content.1.image_url.url"
    assert allowed == 200 and fake.bodies and all("169.254" not in json.dumps(body["messages"][1]["content"][1])
                                                  for body in fake.bodies)
