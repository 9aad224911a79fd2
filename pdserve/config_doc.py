"""Render the documented example configuration from the pydantic models, so it cannot drift."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from pdserve.config import Settings

# Sections only a Kubernetes or EKS deployment reads; set in a file, they hold it to the refusals of
# `render k8s` and `cloud up` (`config validate`, deploy/refusals.py), so the example leaves them commented.
CLUSTER_SECTIONS = ("kubernetes", "eks")


def example_yaml() -> str:
    """Every option with its default and description, as a YAML file that loads as-is; the cluster-only
    sections commented out, so the example validates for this machine."""
    header = [
        "# pdserve configuration. Every key is optional; these are the defaults.",
        "# Precedence: defaults < this file < PDSERVE_SECTION__KEY env vars < command-line flags.",
        f"# {' and '.join(CLUSTER_SECTIONS)} are commented out: uncomment them for `render k8s` and `cloud up`, and",
        "# `config validate` then also refuses what those would.",
    ]
    return "\n".join(header + _commented(_lines(Settings(), indent=0))) + "\n"


def _commented(lines: list[str]) -> list[str]:
    """``lines`` with those of the cluster-only sections behind ``# ``."""
    commented, section = [], ""
    for line in lines:
        section = line.split(":")[0] if not line.startswith(" ") else section
        commented.append(f"# {line}" if section in CLUSTER_SECTIONS else line)
    return commented


def _lines(model: BaseModel, *, indent: int) -> list[str]:
    lines: list[str] = []
    pad = "  " * indent
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        comment = f"  # {field.description}" if field.description else ""
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:{comment}")
            lines.extend(_lines(value, indent=indent + 1))
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}{comment}")
    return lines


def _scalar(value: Any) -> str:
    """JSON is valid YAML flow style, and quotes exactly what needs quoting."""
    return json.dumps(value.value if hasattr(value, "value") else value)
