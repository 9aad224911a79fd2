"""pd/first_delta.py against vLLM's own parsers (qwen3 reasoning, hermes tools, as the engines run them): for every
token of a tokenizer with Qwen3's tags, where it names a delta, that is what the streamed step writes for the token
(``parse_delta``, not finished), and where it says the parser writes nothing, the step writes nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from pdserve.demo.chat_features import CHAT_TEMPLATE, TAGS
from pdserve.pd.first_delta import parsed_delta
from pdserve.pd.first_token import FirstToken, Reason

WORDS = ["hello", "world", "<", "</", "<t", "<tool", "<think", ">", "{", '"name"', ":", "\n", "\n\n", "tool_call"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
FIRST = FirstToken(token_id=0, text="", finish_reason=None, stop_reason=None, prompt_tokens=0, prompt_token_ids=(),
                   reply_id="c",
                   created=1, model="m")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer (each word one token) with ChatML's special tokens, Qwen3's tags and the template."""
    folder = tmp_path_factory.mktemp("tags")
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="hello"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def streamed_and_whole(tokenizer: Any, body: dict[str, Any], token_id: int) -> tuple[dict[str, Any] | None,
                                                                                     dict[str, Any]]:
    """What vLLM's chat server streams for ``token_id`` as a reply's first step, and the message of a whole
    reply of that one token (chat_completion/serving.py: one parser per reply, adjust_request, parse; 0.32 and,
    with vLLM 0.26's package first on PYTHONPATH, 0.26: docs/architecture.md says how)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    parser_cls = ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                          enable_auto_tools=True)
    assert parser_cls is not None
    kwargs = body.get("chat_template_kwargs") or {}
    prompt = tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                           tokenize=True, **kwargs)
    readings: list[tuple[Any, Any]] = []
    for _ in range(2):
        request: Any = ChatCompletionRequest.model_validate(body)
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs)
        readings.append((parser, parser.adjust_request(request)))
    (streaming, request), (whole, _) = readings
    text = tokenizer.decode([token_id], skip_special_tokens=request.skip_special_tokens)
    delta = streaming.parse_delta(text, [token_id], request, prompt_token_ids=list(prompt), finished=False)
    if hasattr(whole, "set_prompt_token_ids"):  # 0.32's server gives it the prompt first; 0.26's parser has none
        whole.set_prompt_token_ids(list(prompt))
    reasoning, content, tool_calls = whole.parse(text, request, enable_auto_tools=True, model_output_token_ids=[token_id])
    message = {"role": "assistant", "content": content, "reasoning": reasoning, "tool_calls": tool_calls or []}
    return (None if delta is None else delta.model_dump(exclude_unset=True)), message


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_the_delta_read_from_a_whole_reply_is_what_vllms_parser_streams_for_every_token(
        tokenizer_dir: Path, thinking: bool, tools: list[dict[str, Any]] | None) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True,
                            "chat_template_kwargs": {"enable_thinking": thinking}, "tools": tools}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    decided = {}
    for token_id in range(len(WORDS) + len(SPECIALS) + len(TAGS)):
        streamed, message = streamed_and_whole(tokenizer, body, token_id)
        read = parsed_delta(body, replace(FIRST, token_id=token_id, message=message), tool_call_parser="hermes")
        if isinstance(read, Reason):
            assert read is Reason.PARSER_UNSURE
            continue
        decided[token_id] = read
        assert (None if read.is_held else read.delta) == streamed, f"token {token_id}: {message}"
    # a tag's prefix may not be decided, nor whitespace with a tool parser (0.26 and 0.32 stream it differently)
    assert all(index in decided for index, word in enumerate(WORDS) if "<" not in word and word.strip())
    tool_call = len(WORDS) + len(SPECIALS) + TAGS.index("<tool_call>")
    assert (tool_call in decided) is bool(tools)  # the tool parser holds its tag: nothing is written for it


def test_a_first_token_that_ends_the_reply_or_calls_a_tool_is_left_to_the_decode_engine() -> None:
    message: dict[str, Any] = {"role": "assistant", "content": "hi", "reasoning": None, "tool_calls": []}
    assert parsed_delta({}, replace(FIRST, message=message, finish_reason="stop"),
                        tool_call_parser="hermes") is Reason.PARSER_UNSURE  # the finish flushes the parser
    called = {**message, "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{}"}}]}
    assert parsed_delta({}, replace(FIRST, message=called), tool_call_parser="hermes") is Reason.PARSER_UNSURE
    both = {**message, "reasoning": "so"}
    assert parsed_delta({}, replace(FIRST, message=both), tool_call_parser="hermes") is Reason.PARSER_UNSURE
    tag = {**message, "content": "<tool_call>"}
    unknown = parsed_delta({"tools": TOOLS}, replace(FIRST, message=tag), tool_call_parser="mistral")
    assert unknown is Reason.PARSER_UNSURE  # a parser whose tag pdserve does not know
