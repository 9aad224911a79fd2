"""Shape folders for dummy-weight GPU runs: the real config, a tokenizer as wide as the vocabulary, no weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pdserve.demo.shapes import FILES, Shape, kv_bytes_per_token, write_shape_model
from pdserve.engines.model_layout import Layout, read_layout


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shape_model(tmp_path_factory.mktemp("shape") / "q8b", Shape.QWEN3_8B)


def test_config_is_qwen3_8b(qwen3_8b: Path) -> None:
    config = json.loads((qwen3_8b / "config.json").read_text())

    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (36, 8, 128)
    assert (config["hidden_size"], config["vocab_size"], config["torch_dtype"]) == (4096, 151936, "bfloat16")
    assert config["transformers_version"]  # without it transformers 5 warns about a Mistral regex


def test_tokenizer_is_padded_to_vocab_size_with_specials_at_the_config_ids(qwen3_8b: Path) -> None:
    config = json.loads((qwen3_8b / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(qwen3_8b / "tokenizer.json"))

    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id("<|im_end|>") == config["eos_token_id"]
    assert tokenizer.token_to_id("<|endoftext|>") == config["bos_token_id"]
    last = config["vocab_size"] - 1
    assert tokenizer.encode(tokenizer.decode([7, last])).ids == [7, last]  # random-id prompts round-trip


def test_chat_requests_render_through_the_shapes_template(qwen3_8b: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_8b))
    messages = [{"role": "system", "content": "t5 t6"}, {"role": "user", "content": "t7"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "t5 t6" in text and "t7" in text and text.endswith("assistant\n")
    assert tokenizer.encode(text, add_special_tokens=False).count(tokenizer.eos_token_id) == 2  # one per turn


def test_no_weights_are_written(qwen3_8b: Path) -> None:
    assert sorted(path.name for path in qwen3_8b.iterdir()) == sorted(FILES)


def test_rewrites_its_own_folder_but_not_a_real_model(tmp_path: Path) -> None:
    write_shape_model(tmp_path / "again", Shape.QWEN3_8B)
    write_shape_model(tmp_path / "again", Shape.QWEN3_8B)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "model.safetensors").write_bytes(b"weights")

    with pytest.raises(FileExistsError, match="model.safetensors"):
        write_shape_model(tmp_path / "real", Shape.QWEN3_8B)


def test_kv_bytes_per_token_of_qwen3_8b() -> None:
    assert kv_bytes_per_token(Shape.QWEN3_8B) == 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, bf16: 144 KiB


def test_cli_writes_a_shape_folder_and_needs_a_dir(tmp_path: Path) -> None:
    def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdserve", "demo-model", *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, check=False)

    assert pdserve("--shape", "qwen3-8b").returncode == 2
    written = pdserve("q8b", "--shape", "qwen3-8b")
    assert written.returncode == 0 and "147,456 bytes per token" in written.stdout
    assert (tmp_path / "q8b" / "config.json").is_file()


def test_qwen3_next_tiny_is_a_gated_deltanet_hybrid(tmp_path: Path) -> None:
    folder = write_shape_model(tmp_path / "tiny", Shape.QWEN3_NEXT_TINY)
    layout = read_layout(str(folder))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    assert layout.layout is Layout.HYBRID and layout.is_gated_deltanet and not layout.has_vision_tower
    assert tokenizer.get_vocab_size() == 4096 and tokenizer.token_to_id("<|im_end|>") == 4095
    assert kv_bytes_per_token(Shape.QWEN3_NEXT_TINY) == 2 * 2 * 2 * 64 * 2  # K and V of its 2 attention layers


def test_qwen3_5_9b_is_the_published_hybrid_with_a_vision_tower(tmp_path: Path) -> None:
    folder = write_shape_model(tmp_path / "q35", Shape.QWEN3_5_9B)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    layout = read_layout(str(folder))

    assert layout.layout is Layout.HYBRID and layout.is_gated_deltanet and layout.has_vision_tower
    assert text["layer_types"].count("linear_attention") == 24 and text["num_hidden_layers"] == 32
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == 248320
    assert kv_bytes_per_token(Shape.QWEN3_5_9B) == 2 * 8 * 4 * 256 * 2  # K and V of its 8 attention layers
