"""Docs figures rendered from docs/results/: `python -m bench.report` rewrites every marked block (see blocks.py)."""
