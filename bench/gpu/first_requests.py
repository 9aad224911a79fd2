"""Which kind of request pays a first-use cost on a prefill engine, and whether a client's first chat through the
gateway still does: in side_by_side.sh's first chat round the first PD chats waited 1.4-2.1 s on the prefill engine
where later ones took 50-200 ms, and the decode engine alone paid nothing on its first chat.

Each kind goes twice straight to the prefill engine, each request with a prompt of its own (a distinct first
block, so no prefix cache hit), one kind closer to the gateway's prefill leg (pd/prefill.py make_body) after the
other; then two streamed chats through the gateway. One JSON line per request: kind, attempt, ms (and first_ms,
to the first generated text, where streamed), prompt tokens.
Standard library only, so it runs from the device stage as it is.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any

_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
       "remote_host": None, "remote_port": None}
_KINDS: list[tuple[str, str, dict[str, Any]]] = [  # (name, path, fields beside the prompt)
    ("completion", "/v1/completions", {"max_tokens": 1}),
    ("chat-streamed", "/v1/chat/completions", {"max_tokens": 2, "stream": True}),
    ("chat", "/v1/chat/completions", {"max_tokens": 1}),
    ("chat-token-ids", "/v1/chat/completions", {"max_tokens": 1, "return_token_ids": True}),
    ("chat-token-ids-kv", "/v1/chat/completions", {"max_tokens": 1, "return_token_ids": True, "kv_transfer_params": _KV}),
    ("chat-token-ids-kv-logprobs", "/v1/chat/completions", {"max_tokens": 1, "return_token_ids": True,
                                                            "kv_transfer_params": _KV, "logprobs": True, "top_logprobs": 0}),
]


def _prompt(tag: str, words: int) -> str:
    return f"{tag}: " + " ".join(f"w{index % 97} x{index % 13}" for index in range(words))


def _send(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request's whole time (ms), its first generated text's (``first_ms``, streamed only) and prompt tokens."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    first_ms = None
    with urllib.request.urlopen(request, timeout=300) as reply:
        if body.get("stream"):
            for line in reply:
                if first_ms is None and _generated(line):
                    first_ms = round((time.perf_counter() - started) * 1000, 1)
            prompt_tokens = None
        else:
            prompt_tokens = (json.loads(reply.read()).get("usage") or {}).get("prompt_tokens")
    return {"ms": round((time.perf_counter() - started) * 1000, 1), "first_ms": first_ms, "prompt_tokens": prompt_tokens}


def _generated(line: bytes) -> bool:
    """Whether an SSE line carries generated text (a chat's role event carries none)."""
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(choices[0].get("text") or delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"))


def _body(model: str, path: str, prompt: str, fields: dict[str, Any]) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": model, "prompt": prompt, **fields}
    return {"model": model, "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "go on"}],
            **fields}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", required=True, help="the prefill engine's URL")
    parser.add_argument("--gateway", required=True, help="the gateway's URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--words", type=int, default=1000, help="prompt length in words (two tokens or more each)")
    parser.add_argument("--gateway-only", action="store_true", help="only the chats through the gateway")
    args = parser.parse_args()
    plan = [] if args.gateway_only else [(name, args.prefill, path, fields) for name, path, fields in _KINDS]
    plan.append(("gateway-chat-streamed", args.gateway, "/v1/chat/completions", {"max_tokens": 4, "stream": True}))
    for name, url, path, fields in plan:
        for attempt in (1, 2):
            sent = _send(url, path, _body(args.model, path, _prompt(f"{name} {attempt}", args.words), fields))
            print(json.dumps({"kind": name, "attempt": attempt, **sent}), flush=True)


if __name__ == "__main__":
    main()
