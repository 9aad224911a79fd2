"""Prompt text of a requested length in tokens: exact-ish from a tokenizer, else from words.

Every prompt starts with different random words, so the engines' prefix caches cannot turn
a prefill benchmark into a cache benchmark (the chat workload shares a prefix on purpose).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol

# Short, frequent English words: one token each in BPE vocabularies, so N words ~ N tokens.
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against go "
    "came right used take three"
)
WORDS = tuple(_WORD_TEXT.split())


class PromptMaker(Protocol):
    def make(self, tokens: int, *, rng: random.Random) -> str: ...


class WordPrompts:
    """Roughly one token per word for real tokenizers; the fallback when none is at hand."""

    def make(self, tokens: int, *, rng: random.Random) -> str:
        return " ".join(rng.choices(WORDS, k=tokens))


class TokenizerPrompts:
    """Cut random words to exactly ``tokens`` token ids and decode them (re-encoding may differ by one).

    A vocabulary that does not know English words (a placeholder tokenizer for dummy weights)
    would turn every prompt into the same unknown token, and the prefix cache would answer
    every prefill: then random ids from the whole vocabulary are used instead.
    """

    def __init__(self, tokenizer_file: Path) -> None:
        from tokenizers import Tokenizer  # the demo extra; only needed when a tokenizer is used

        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        probe = self._tokenizer.encode(" ".join(WORDS), add_special_tokens=False).ids
        self._knows_words = len(set(probe)) > len(WORDS) // 2

    def make(self, tokens: int, *, rng: random.Random) -> str:
        if not self._knows_words:
            ids = [rng.randrange(self._tokenizer.get_vocab_size()) for _ in range(tokens)]
            return str(self._tokenizer.decode(ids))
        ids = []
        words = tokens
        while len(ids) < tokens:
            ids = self._tokenizer.encode(" ".join(rng.choices(WORDS, k=words)), add_special_tokens=False).ids
            words *= 2
        text: str = self._tokenizer.decode(ids[:tokens])
        return text


def prompt_maker(tokenizer_file: Path | None) -> PromptMaker:
    """A tokenizer-exact maker when ``tokenizer_file`` exists, else the word-based one."""
    if tokenizer_file is not None and tokenizer_file.is_file():
        return TokenizerPrompts(tokenizer_file)
    return WordPrompts()
