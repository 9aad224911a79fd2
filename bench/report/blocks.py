"""Find and rewrite the rendered blocks of a Markdown text; pure, no I/O.

A block is ``<!-- render: NAME [FOLDER ...] -->CONTENT<!-- /render -->``: NAME picks a renderer
(registry.py), each FOLDER is a raw folder under docs/results/. CONTENT that starts on a new line is a
block (a table); CONTENT on the marker's line is an inline figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_BLOCK = re.compile(r"<!-- render: (?P<call>[^>]*?) -->(?P<content>.*?)<!-- /render -->", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Block:
    name: str
    folders: tuple[str, ...]
    content: str
    line: int

    @property
    def is_inline(self) -> bool:
        return not self.content.startswith("\n")


def find_blocks(text: str) -> list[Block]:
    """Every marked block of ``text``, in order, with the 1-based line of its opening marker."""
    blocks = []
    for match in _BLOCK.finditer(text):
        name, *folders = match.group("call").split()
        blocks.append(Block(name, tuple(folders), match.group("content"), text.count("\n", 0, match.start()) + 1))
    return blocks


def rewrite(text: str, render: Callable[[Block], str]) -> str:
    """``text`` with each block's content replaced by ``render(block)``; a table keeps its own lines."""

    def replace(match: re.Match[str]) -> str:
        block = find_blocks(match.group(0))[0]
        body = render(block)
        content = body if block.is_inline else f"\n{body.strip(chr(10))}\n"
        return f"<!-- render: {match.group('call')} -->{content}<!-- /render -->"

    return _BLOCK.sub(replace, text)
