"""What owning the chat layer would cost the gateway per request: vLLM's own parsers run in one process
(docs/architecture.md, step 3, "Why the chat layer stays on the engines").

    python bench/chat_parser_cost.py

CPU time of: validating a chat request as vLLM's ChatCompletionRequest (a 2048-word system prompt, 7 turns of
256 words, one tool), building vLLM's parser for it (qwen3 reasoning + hermes tools, as --reasoning-parser and
--tool-call-parser name them), and one ``parse_delta`` per generated token inside a thinking block. The tokenizer
is a word-level one with Qwen's four tags added: the parsers look only at those tags' ids and the delta text.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

WORDS = [f"w{index}" for index in range(3000)]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(["[UNK]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    fast.add_tokens(TAGS)
    return fast


def request_json() -> str:
    turn = " ".join(WORDS[:256])
    messages: list[dict[str, Any]] = [{"role": "system", "content": " ".join(WORDS[i % 3000] for i in range(2048))}]
    messages += [{"role": role, "content": turn} for role in ("user", "assistant") * 3 + ("user",)]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    return json.dumps({"model": "m", "stream": True, "max_tokens": 256, "messages": messages, "tools": [tool]})


def cpu_us(work: Any, rounds: int) -> float:
    started = time.process_time()
    for _ in range(rounds):
        work()
    return (time.process_time() - started) / rounds * 1e6


def main() -> None:
    fast = tokenizer()
    parser_cls = ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                          enable_auto_tools=True)
    assert parser_cls is not None
    raw = request_json()
    request = ChatCompletionRequest.model_validate_json(raw)
    prompt = [fast.convert_tokens_to_ids("<think>"), 5, 6]  # reasoning still open at the end of the prompt
    tokens = list(range(2, 258))

    def stream_one_reply() -> None:
        parser = parser_cls(fast, request.tools, chat_template_kwargs={}, model_config=None)
        for token in tokens:
            parser.parse_delta(" " + fast.decode([token]), [token], request, prompt, finished=False)

    validate_us = cpu_us(lambda: ChatCompletionRequest.model_validate_json(raw), 200)
    make_us = cpu_us(lambda: parser_cls(fast, request.tools, chat_template_kwargs={}, model_config=None), 200)
    reply_us = cpu_us(stream_one_reply, 20)
    print(f"validate ChatCompletionRequest: {validate_us:.0f} us per request")
    print(f"build the parser: {make_us:.0f} us per request")
    print(f"parse_delta: {(reply_us - make_us) / len(tokens):.1f} us per token (a {len(tokens)}-token reply)")


if __name__ == "__main__":
    main()
