"""``python -m bench.report [--check] [DOC ...]``: rewrite the docs' rendered blocks, or list those out of date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report.render import doc_paths, render_text, stale_blocks

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("docs", nargs="*", type=Path, help="Markdown files (default: README.md, docs/*.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "results", help="the raw folders' root")
    args = parser.parse_args(argv)
    docs = args.docs or doc_paths(REPO)
    if args.check:
        stale = [entry for doc in docs for entry in stale_blocks(doc, args.results)]
        for entry in stale:
            print(entry)
        return 1 if stale else 0
    for doc in docs:
        text = doc.read_text()
        rendered = render_text(text, args.results)
        if rendered != text:
            doc.write_text(rendered)
            print(f"rendered {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
