"""What the demo model reads: English prose that ships inside Python's stdlib, and a tokenizer trained on it.

The text comes from the running interpreter's own files, so every machine of one image sees the
same bytes with no download. Stdlib modules are parsed, never imported (importing runs their side
effects). No network; nothing is written here (model.py saves the tokenizer).
"""

import ast
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
VOCAB_SIZE = 4096
MAX_CONTEXT_TOKENS = 4096

# Qwen's ChatML shape, minus tools and thinking: the demo model only ever holds a plain conversation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_QUESTIONS = ("What does {} do?", "Explain {}.", "Tell me about {}.")
_MIN_DOCSTRING_CHARS = 80
_MIN_PARAGRAPH_CHARS = 40
_MIN_WORDLIKE_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Passage:
    """One piece of prose and the name it describes ("assert" for a pydoc topic, "json.dumps" for a docstring)."""

    title: str
    body: str


def load_passages(stdlib_dir: Path) -> list[Passage]:
    """Collect pydoc's language-reference topics and the docstrings of the top-level stdlib modules.

    `stdlib_dir` is the interpreter's stdlib folder (`sysconfig.get_path("stdlib")`). Order is fixed
    (topics by name, files by name, docstrings in tree order), so the result is reproducible.
    """
    found = [Passage(title=name.replace("-", " "), body=topics[name]) for name in sorted(topics)]
    for source in sorted(stdlib_dir.glob("*.py")):
        found.extend(_docstrings(source))
    passages = [Passage(title=passage.title, body=_prose(passage.body)) for passage in found]
    return [passage for passage in passages if passage.body]


def _prose(text: str) -> str:
    """Keep only the prose paragraphs, each joined onto one line.

    Code samples, tables and hard line wraps would otherwise teach a small model that newlines and
    indentation are the most likely next token, and greedy decoding would emit nothing else.
    """
    paragraphs = (" ".join(line.strip() for line in block.splitlines()) for block in _blocks(text))
    return "\n\n".join(paragraph for paragraph in paragraphs if _is_prose(paragraph))


def _blocks(text: str) -> Iterator[str]:
    for block in text.strip().split("\n\n"):
        lines = block.strip("\n").splitlines()
        if lines and not any(line.startswith((" ", "\t")) or ">>>" in line for line in lines):
            yield block


def _is_prose(paragraph: str) -> bool:
    wordlike = sum(char.isalpha() or char == " " for char in paragraph)
    return len(paragraph) >= _MIN_PARAGRAPH_CHARS and wordlike >= _MIN_WORDLIKE_SHARE * len(paragraph)


def _docstrings(source: Path) -> Iterator[Passage]:
    module = source.stem
    tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = ast.get_docstring(node)
        if body is not None and len(body) >= _MIN_DOCSTRING_CHARS:
            title = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
            yield Passage(title=title, body=body)


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """Render (role, content) pairs exactly as CHAT_TEMPLATE does, so training matches serving."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def render_documents(passages: Sequence[Passage]) -> list[str]:
    """Turn passages into training documents: every other one as a one-turn chat, the rest as raw prose.

    Chats teach the model to answer after `<|im_start|>assistant` and to stop with `<|im_end|>`;
    raw prose keeps plain completions word-like. Each document ends with `<|endoftext|>`.
    """
    documents = []
    for index, passage in enumerate(passages):
        if index % 2 == 0:
            text = passage.body
        else:
            question = _QUESTIONS[index // 2 % len(_QUESTIONS)].format(passage.title)
            text = render_chat([("user", question), ("assistant", passage.body)])
        documents.append(text + END_OF_TEXT)
    return documents


def train_tokenizer(documents: Sequence[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer of VOCAB_SIZE entries on `documents`; special tokens take ids 0, 1, 2.

    Byte-level means any input text encodes (no unknown token), as with Qwen's own tokenizer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # BPE training does not split out special tokens, so hide them or merges like "?<|" appear.
    tokenizer.train_from_iterator([_without_special_tokens(text) for text in documents], trainer=trainer)
    return tokenizer


def _without_special_tokens(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of one of SPECIAL_TOKENS, which training always puts in the vocabulary."""
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, f"{token} missing from the trained vocabulary"
    return token_id


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json (with the chat template) that transformers and vLLM load."""
    tokenizer.save(str(directory / "tokenizer.json"))
    added_tokens = {
        str(special_token_id(tokenizer, token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_CONTEXT_TOKENS,
        "split_special_tokens": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
