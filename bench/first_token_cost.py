"""The gateway's added CPU per request for a streamed chat whose first token comes from the prefill engine
(pd/first_token.py, pd/lead.py), against 9a77e7e's chat path, which had none: in-process, no network.

    PYTHONPATH=. python bench/first_token_cost.py [--prompt-tokens 3840]

Added: the prefill reply's prompt token ids (``return_token_ids``) to cut out before parsing
(first_token.without_chat_prompt_ids), reading the token, the lead's events and the decode leg's body, and
dropping the decode engine's echo of the first step. What 9a77e7e
did for chat (parse the prefill reply without ids, build the decode body) is timed as the baseline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import pydantic_core

from pdserve.pd import decode, first_token
from pdserve.pd.first_token import FirstToken
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.lead import Lead, drop_echoed, make_lead
from pdserve.pd.resume import CHAT_PATH

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(240))],
      "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r", "tp_size": 1}


def prefill_reply(prompt_tokens: int, *, with_ids: bool) -> bytes:
    """vLLM 0.32's non-streamed chat reply to a prefill leg (chat_completion/serving.py:1095-1205)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "Hello", "reasoning": None, "tool_calls": []},
              "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": [7] if with_ids else None}
    return pydantic_core.to_json({
        "id": "chatcmpl-r", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1, "completion_tokens": 1},
        "prompt_token_ids": list(range(1000, 1000 + prompt_tokens)) if with_ids else None,
        "kv_transfer_params": {**KV, "remote_num_tokens": prompt_tokens}})


def cpu_us(work: Callable[[], object], rounds: int = 2000) -> float:
    started = time.process_time()
    for _ in range(rounds):
        work()
    return (time.process_time() - started) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048 + 7 * 256)
    args = parser.parse_args()
    body = {"model": "m", "messages": [{"role": "user", "content": "x " * args.prompt_tokens}], "stream": True,
            "max_tokens": 256, "stream_options": {"include_usage": True}}
    plain, with_ids = prefill_reply(args.prompt_tokens, with_ids=False), prefill_reply(args.prompt_tokens, with_ids=True)

    def before() -> None:  # 9a77e7e: the reply read, the decode body made
        reply = pydantic_core.from_json(plain)
        decode.make_body(body, KVTransferParams(fields=reply["kv_transfer_params"], prompt_tokens=args.prompt_tokens))

    echo = None

    def after() -> Lead:
        reply = pydantic_core.from_json(first_token.without_chat_prompt_ids(with_ids))
        first_token.why_not(body, path=CHAT_PATH, is_stream=True, decode_forces=True, parses_chat=False)
        first = first_token.read(reply)
        assert isinstance(first, FirstToken)
        first = first_token.for_client(body, first, path=CHAT_PATH, max_model_len=None)
        kv = KVTransferParams(fields=reply["kv_transfer_params"], prompt_tokens=args.prompt_tokens, first=first)
        made = make_lead(body, first, kv, path=CHAT_PATH)
        assert not isinstance(made, first_token.Reason)
        _, lead = made
        drop_echoed(echo or lead.events, lead.echoed_events, lead=lead, path=CHAT_PATH)
        return lead

    echo = after().events  # the decode engine's first step is the lead's own events, as vLLM writes them
    before_us, after_us = cpu_us(before), cpu_us(after)
    print(f"{args.prompt_tokens}-token chat prompt: 9a77e7e {before_us:.1f} us, prefill token first {after_us:.1f} us, "
          f"added {after_us - before_us:.1f} us per request")


if __name__ == "__main__":
    main()
