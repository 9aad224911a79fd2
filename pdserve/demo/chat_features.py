"""A model folder's chat features: Qwen3's thinking and tool-call tags as tokens, and a chat template that
renders tools, tool calls and a thinking block, so engines run with ``--reasoning-parser qwen3
--tool-call-parser hermes`` have something to parse. Rewrites the folder's tokenizer, config and weights.

The tags are added tokens that are not special, as in Qwen3's tokenizer (detokenizing keeps them); each gets
a new id after the vocabulary, a seeded embedding row and, where the model has its own output layer, a zero
row there (a random model then never prefers them: a request forces them, e.g. with ``logit_bias``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MARKER_FILE = "pdserve-chat-features.json"
EMBEDDING = "model.embed_tokens.weight"
OUTPUT = "lm_head.weight"
_SEED = 0
_EMBEDDING_STD = 0.02

# Written here after Qwen3's conventions: tools listed in the system turn inside <tools></tools>, one JSON
# object per call between <tool_call> tags, tool results as a user turn inside <tool_response>, earlier
# reasoning inside <think></think>. The generation prompt opens the thinking block as Qwen3.5's does
# (the model writes its reasoning, then </think>); enable_thinking false closes it empty, as Qwen3's does.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ('user', 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' }}"
    "{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def add_chat_features(model_dir: Path) -> dict[str, int | None]:
    """Give the model in ``model_dir`` (config.json, tokenizer.json, tokenizer_config.json, model.safetensors)
    the TAGS as tokens and CHAT_TEMPLATE. Raises ValueError if it has them already. Returns each tag's id."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if any(tokenizer.token_to_id(tag) is not None for tag in TAGS):
        raise ValueError(f"{model_dir} has chat features already")
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    ids = {tag: tokenizer.token_to_id(tag) for tag in TAGS}
    assert all(isinstance(token_id, int) for token_id in ids.values()), ids
    tokenizer.save(str(model_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    _grow_weights(model_dir / "model.safetensors", vocab_size=vocab_size)
    _rewrite_json(model_dir / "config.json", vocab_size=vocab_size)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    decoder = tokenizer_config.setdefault("added_tokens_decoder", {})
    for tag, token_id in ids.items():
        decoder[str(token_id)] = {"content": tag, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    return ids


def copy_with_chat_features(source: Path, target: Path) -> Path:
    """``source``'s model (a demo build, or a shape folder) as a copy in ``target`` with the chat features,
    replacing an earlier such copy. Raises FileExistsError where ``target`` holds anything else."""
    if target.exists() and any(target.iterdir()) and not (target / MARKER_FILE).exists():
        raise FileExistsError(f"{target} holds files that are not a pdserve chat-features model; refusing to replace it")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("pdserve-*.json"))
    ids = add_chat_features(target)
    (target / MARKER_FILE).write_text(json.dumps({"source": str(source), "tags": ids}, indent=2) + "\n",
                                      encoding="utf-8")
    return target


def _grow_weights(path: Path, *, vocab_size: int) -> None:
    """Rows for the new ids: seeded ones in the embedding, zeros in an untied output layer."""
    if not path.exists():
        return  # a shape folder without weights, for --load-format dummy
    weights = load_file(path)
    generator = torch.Generator().manual_seed(_SEED)
    for name in (EMBEDDING, OUTPUT):
        if name not in weights:
            continue  # tied output layer: the embedding serves
        old = weights[name]
        rows = vocab_size - old.shape[0]
        new = (torch.randn(rows, old.shape[1], generator=generator) * _EMBEDDING_STD if name == EMBEDDING
               else torch.zeros(rows, old.shape[1]))
        weights[name] = torch.cat([old, new.to(old.dtype)]).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    path.chmod(0o644)


def _rewrite_json(path: Path, *, vocab_size: int) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    config["vocab_size"] = vocab_size
    path.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
