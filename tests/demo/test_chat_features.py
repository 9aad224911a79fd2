"""demo/chat_features.py: Qwen3's tags become tokens of their own after the vocabulary, the weights grow to match,
and the chat template renders tools, tool calls, tool results and a thinking block as the parsers read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from pdserve.demo.chat_features import MARKER_FILE, TAGS, add_chat_features, copy_with_chat_features
from pdserve.demo.random_weights import write_random_weights
from pdserve.demo.shapes import Shape, write_shape_model

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_shape_model(tmp_path_factory.mktemp("tiny") / "model", Shape.QWEN3_NEXT_TINY)
    write_random_weights(folder)
    return copy_with_chat_features(folder, folder.with_name("chat"))


def test_each_tag_is_one_new_token_and_the_weights_and_config_grow_to_it(hybrid: Path) -> None:
    ids = json.loads((hybrid / MARKER_FILE).read_text())["tags"]
    assert list(ids) == list(TAGS) and sorted(ids.values()) == [4096, 4097, 4098, 4099]
    tokenizer = AutoTokenizer.from_pretrained(hybrid)
    assert tokenizer.encode("t5 <tool_call> t6") == [5, 4098, 6] and tokenizer.decode([4096]) == "<think>"
    weights = load_file(hybrid / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape[0] == weights["lm_head.weight"].shape[0] == 4100
    assert not weights["lm_head.weight"][4096:].any()  # a random model never prefers a tag on its own
    assert json.loads((hybrid / "config.json").read_text())["vocab_size"] == 4100
    with pytest.raises(ValueError, match="already"):
        add_chat_features(hybrid)


def test_the_template_renders_tools_calls_results_and_an_open_or_closed_thinking_block(hybrid: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(hybrid)
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "t1"},
                {"role": "assistant", "content": None, "reasoning_content": "t2",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]},
                {"role": "tool", "content": "t3"}]
    text = str(tokenizer.apply_chat_template(messages, tools=list[Any](TOOLS), add_generation_prompt=True, tokenize=False))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "get_weather"' in text
    assert '<think>\nt2\n</think>\n\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nt3\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # open: the model reasons first (Qwen3.5)
    closed = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    assert closed == "<|im_start|>user\nt1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_folder_that_is_not_a_chat_features_copy_is_never_replaced(hybrid: Path, tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        copy_with_chat_features(hybrid, tmp_path)
    assert copy_with_chat_features(hybrid.with_name("model"), hybrid) == hybrid  # its own copy is rebuilt
