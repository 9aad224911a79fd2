"""The demo model's bytes: train the tokenizer and weights and write the checkpoint. Imports torch and
transformers, so model.py loads it only when a folder must be (re)built."""

from __future__ import annotations

import json
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

from pdserve.demo import corpus, train
from pdserve.demo.plan import TrainPlan

# float32, not bfloat16: the model is tiny, and full precision keeps greedy output identical
# between a prefill/decode pair and one local engine (vLLM needs `--dtype float32` to keep it).
WEIGHTS_DTYPE = torch.float32


def build_into(staging: Path, *, plan: TrainPlan, progress: Callable[[str], None]) -> None:
    """Tokenizer, trained weights and configs into ``staging``; model.py seals and moves it."""
    started = time.monotonic()
    passages = corpus.load_passages(Path(sysconfig.get_path("stdlib")))
    documents = corpus.render_documents(passages)
    tokenizer = corpus.train_tokenizer(documents)
    corpus.save_tokenizer(tokenizer, staging)
    token_ids = torch.tensor([token for encoding in tokenizer.encode_batch(documents) for token in encoding.ids])
    progress(f"demo model: {len(passages)} passages, {token_ids.numel()} tokens, vocab {tokenizer.get_vocab_size()}")
    config = train.make_config(
        vocab_size=corpus.VOCAB_SIZE,
        bos_token_id=corpus.special_token_id(tokenizer, corpus.END_OF_TEXT),
        eos_token_id=corpus.special_token_id(tokenizer, corpus.IM_END),
        max_position_embeddings=corpus.MAX_CONTEXT_TOKENS,
    )
    model = train.train_model(token_ids, config=config, plan=plan, progress=progress)
    _save_weights(model, staging)
    _save_generation_config(tokenizer, staging)
    progress(f"demo model: built in {time.monotonic() - started:.1f}s")


def _save_weights(model: Qwen3ForCausalLM, staging: Path) -> None:
    """Write config.json and model.safetensors without lm_head (it is the tied embedding)."""
    model.config.dtype = WEIGHTS_DTYPE
    model.config.save_pretrained(staging)
    weights = {name: tensor.to(WEIGHTS_DTYPE).contiguous() for name, tensor in model.state_dict().items()}
    del weights["lm_head.weight"]
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})


def _save_generation_config(tokenizer: Tokenizer, staging: Path) -> None:
    """Chat answers end with <|im_end|>, plain completions with <|endoftext|>: either one stops generation."""
    end_of_text = corpus.special_token_id(tokenizer, corpus.END_OF_TEXT)
    generation = {
        "bos_token_id": end_of_text,
        "eos_token_id": [corpus.special_token_id(tokenizer, corpus.IM_END), end_of_text],
        "pad_token_id": end_of_text,
    }
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
