"""Render every marked block of a doc from docs/results/, and list the blocks a doc holds out of date."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.report.blocks import Block, find_blocks, rewrite
from bench.report.registry import renderers

DOCS = ("README.md", "docs/*.md")


@dataclass(frozen=True, slots=True)
class Stale:
    doc: Path
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: block `{self.name}` differs from what its raw files render"


def doc_paths(repo: Path) -> list[Path]:
    return [path for pattern in DOCS for path in sorted(repo.glob(pattern))]


def render_text(text: str, results_dir: Path) -> str:
    """``text`` with every block rendered again; an unknown renderer name raises KeyError."""
    table = renderers()

    def render(block: Block) -> str:
        return table[block.name](results_dir, block.folders)

    return rewrite(text, render)


def stale_blocks(doc: Path, results_dir: Path) -> list[Stale]:
    """The blocks of ``doc`` whose content is not what its raw files render now."""
    text = doc.read_text()
    rendered = find_blocks(render_text(text, results_dir))
    return [Stale(doc, old.line, old.name) for old, new in zip(find_blocks(text), rendered, strict=True)
            if old.content != new.content]
