"""The demo model builds offline, deterministically, loads in transformers and writes word-like text."""

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from pdserve.demo import corpus
from pdserve.demo.build import WEIGHTS_DTYPE
from pdserve.demo.model import MARKER_FILE, WEIGHTS_DTYPE_NAME, build_demo_model, default_demo_model_dir

EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SHORT_TRAIN_STEPS = 10
CHAT_QUESTIONS = ("What does json.dumps do?", "Tell me about the list type.", "Hello! How are you?")
COMPLETION_PROMPTS = ("The list is", "Return the")
MIN_DISTINCT_WORDS = 8
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def built_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The demo model with the shipped recipe, built once (about a minute) with its progress lines."""
    lines: list[str] = []
    model_dir = build_demo_model(tmp_path_factory.mktemp("demo") / "model", progress=lines.append)
    return model_dir, lines


@pytest.fixture(scope="session")
def barely_trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build that stops after a few steps: cheap, and still the full pipeline."""
    return build_demo_model(
        tmp_path_factory.mktemp("demo-short") / "model", progress=_quiet, train_steps=SHORT_TRAIN_STEPS
    )


@pytest.fixture(scope="session")
def untrained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same recipe with no training steps: its output is what the word-like check must reject."""
    return build_demo_model(tmp_path_factory.mktemp("demo-untrained") / "model", progress=_quiet, train_steps=0)


@pytest.fixture(scope="session")
def corpus_words() -> frozenset[str]:
    passages = corpus.load_passages(Path(sysconfig.get_path("stdlib")))
    return frozenset(word.lower() for passage in passages for word in _words(passage.body))


def test_build_writes_a_qwen3_checkpoint(built_model: tuple[Path, list[str]]) -> None:
    model_dir, _ = built_model
    assert all((model_dir / name).is_file() for name in (*EXPECTED_FILES, MARKER_FILE))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["head_dim"] in (64, 128)
    assert config["vocab_size"] == corpus.VOCAB_SIZE


def test_build_reports_training_progress(built_model: tuple[Path, list[str]]) -> None:
    _, lines = built_model
    step_lines = [line for line in lines if " step " in line]
    assert len(step_lines) >= 2
    assert all("loss" in line and "elapsed" in line for line in step_lines)


def test_tokenizer_renders_the_chat_template(built_model: tuple[Path, list[str]]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built_model[0])
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = corpus.render_chat([("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")])
    assert rendered == expected + f"{corpus.IM_START}assistant\n"
    assert tokenizer.eos_token == corpus.IM_END
    assert all(len(tokenizer.encode(token, add_special_tokens=False)) == 1 for token in corpus.SPECIAL_TOKENS)


def test_second_build_is_a_no_op(built_model: tuple[Path, list[str]]) -> None:
    model_dir, _ = built_model
    weights_mtime_ns = (model_dir / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    assert build_demo_model(model_dir, progress=lines.append) == model_dir
    assert lines == [f"demo model: {model_dir} is up to date"]
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime_ns


def test_rebuild_of_a_damaged_dir_gives_identical_bytes(barely_trained_model: Path, tmp_path: Path) -> None:
    damaged = shutil.copytree(barely_trained_model, tmp_path / "model")
    (damaged / "model.safetensors").write_bytes(b"truncated")
    build_demo_model(damaged, progress=_quiet, train_steps=SHORT_TRAIN_STEPS)
    for name in (*EXPECTED_FILES, MARKER_FILE):
        assert (damaged / name).read_bytes() == (barely_trained_model / name).read_bytes(), name
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # no staging folder left behind


def test_build_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_demo_model(tmp_path, progress=_quiet, train_steps=0)
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_trained_model_writes_wordlike_text(built_model: tuple[Path, list[str]], corpus_words: frozenset[str]) -> None:
    text = _greedy_outputs(built_model[0])
    assert _is_wordlike(text, corpus_words), text


def test_wordlike_check_rejects_an_untrained_model(untrained_model: Path, corpus_words: frozenset[str]) -> None:
    text = _greedy_outputs(untrained_model)
    assert not _is_wordlike(text, corpus_words), text


def test_default_dir_is_under_the_cache_home() -> None:
    assert default_demo_model_dir(Path("/home/a/.cache")) == Path("/home/a/.cache/pdserve/demo-model")


def _greedy_outputs(model_dir: Path) -> str:
    """Greedy continuations of a few chat and plain prompts, joined into one text."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen3ForCausalLM.from_pretrained(model_dir)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question in CHAT_QUESTIONS
    ]
    stop_ids = set(json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"])
    outputs = []
    for prompt in (*chats, *COMPLETION_PROMPTS):
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        new_ids = _greedy(model, token_ids, stop_ids=stop_ids)
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        assert isinstance(text, str)
        outputs.append(text)
    return "\n".join(outputs)


def _greedy(model: Qwen3ForCausalLM, token_ids: list[int], *, stop_ids: set[int]) -> list[int]:
    """Argmax decoding without a KV cache: slow in theory, instant at this size, and free of generate()'s options."""
    new_ids: list[int] = []
    with torch.no_grad():
        while len(new_ids) < MAX_NEW_TOKENS:
            logits = model(input_ids=torch.tensor([token_ids + new_ids])).logits
            next_id = int(logits[0, -1].argmax())
            if next_id in stop_ids:
                break
            new_ids.append(next_id)
    return new_ids


def _is_wordlike(text: str, vocabulary: frozenset[str]) -> bool:
    """Mostly letters and spaces, mostly corpus words, and not one word repeated.

    Each clause alone lets some untrained output through: random BPE pieces glue into non-words,
    an unlucky init repeats one real word, and a barely trained model emits only newlines.
    """
    words = [word.lower() for word in _words(text)]
    letters_or_spaces = sum(char.isalpha() or char == " " for char in text)
    known = [word for word in words if word in vocabulary]
    return (
        letters_or_spaces >= 0.75 * len(text)
        and len(known) >= 0.9 * len(words)
        and len(set(known)) >= MIN_DISTINCT_WORDS
    )


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def _quiet(line: str) -> None:
    del line


def test_checking_a_built_folder_imports_no_torch() -> None:
    """`pdserve up` checks the demo model at every start: importing torch for that cost seconds."""
    check = "import sys, pdserve.demo.model; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout == "[]\n"
    assert str(WEIGHTS_DTYPE) == WEIGHTS_DTYPE_NAME  # the recipe names the dtype the build writes
