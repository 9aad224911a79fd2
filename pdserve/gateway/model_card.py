"""What ``/v1/models`` lists: the engines' own model card, as vLLM gives it, read once and kept.

vLLM's card says where the model lives (``root``) and its context length (``max_model_len``);
load tools find the tokenizer through ``root`` (``vllm bench serve`` with no ``--model``). It
cannot change while the engines run. Until an engine has answered, a card made from the config.
A client other than the admin gets ``root`` only where it is a Hugging Face model id, never a path on disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import aiohttp

from pdserve.config import Settings
from pdserve.role import Role
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 5.0
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # Qwen/Qwen3-8B: what the Hub names a model by


class ModelCards:
    """The served model's card: fetched from the first engine that answers, then kept."""

    def __init__(self, session: aiohttp.ClientSession, *, settings: Settings,
                 timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self._session, self._timeout_s = session, timeout_s
        self._served_name = settings.model.served_name
        self._fallback = config_card(settings)
        self._card: dict[str, Any] | None = None
        self._without_card: set[str] = set()  # engines that failed to give one: said once each
        self._lock = asyncio.Lock()

    @property
    def is_from_engine(self) -> bool:
        return self._card is not None

    @property
    def max_model_len(self) -> int | None:
        """The engines' context length in tokens, once an engine has given its card."""
        length = None if self._card is None else self._card.get("max_model_len")
        return length if isinstance(length, int) else None

    async def fetch_once_up(self, pool: Pool, *, interval_s: float) -> None:
        """Fetch the engines' card once an engine is healthy: a reply whose prompt fills the context
        ends at the prefill engine's token (pd/first_token.py), which needs its length."""
        while self._card is None:
            await self.card(pool)
            if self._card is None:
                await asyncio.sleep(interval_s)

    async def card(self, pool: Pool) -> dict[str, Any]:
        """The engines' card (asking the healthy engines in turn, decode first, until one answers),
        else the config's."""
        if self._card is None:
            async with self._lock:  # many clients at start-up: one fetch
                for url in [endpoint.url for role in (Role.DECODE, Role.PREFILL) for endpoint in pool.healthy(role)]:
                    if self._card is not None:
                        break
                    self._card = await self._fetch(url)
        return self._card or self._fallback

    async def _fetch(self, url: str) -> dict[str, Any] | None:
        """The card for the served model in ``url``'s ``/v1/models``, with the id clients send; None if
        the engine did not answer with one."""
        try:
            async with self._session.get(f"{url}/v1/models",
                                         timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as reply:
                reply.raise_for_status()
                listing = json.loads(await reply.read())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if url not in self._without_card:
                self._without_card.add(url)
                log.info("engine %s gave no model card (%r); /v1/models lists the configured one meanwhile", url,
                         exc)
            return None
        return pick_card(listing, self._served_name)


def pick_card(listing: object, served_name: str) -> dict[str, Any] | None:
    """From a vLLM ``/v1/models`` reply: the card of ``served_name`` (else the first), with ``id``
    set to ``served_name``; None if ``listing`` holds no card. Pure."""
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return None
    cards = [card for card in cards if isinstance(card, dict)]
    if not cards:
        return None
    named = [card for card in cards if card.get("id") == served_name]
    return {**(named or cards)[0], "id": served_name}


def without_path(card: dict[str, Any]) -> dict[str, Any]:
    """``card`` with a ``root`` that is no Hugging Face model id (a folder on the engines' disk) replaced by the
    card's ``id``, the name clients send; vLLM's other fields stay. Pure."""
    root = card.get("root")
    if isinstance(root, str) and _HUB_ID.fullmatch(root) and ".." not in root:
        return card
    return {**card, "root": card.get("id")}


def config_card(settings: Settings) -> dict[str, Any]:
    """The card vLLM would give, made from the config: ``root`` is the configured model (the demo
    model's folder on this host when none is configured). Pure."""
    model = settings.model
    return {"id": model.served_name, "object": "model", "created": 0, "owned_by": "vllm",
            "root": model.path or str(settings.demo_model_dir), "parent": None,
            "max_model_len": model.max_model_len, "permission": []}
