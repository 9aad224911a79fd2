"""The structured-output parts of a request (response_format, structured_outputs, each tool's parameters) held to
gateway.max_schema_bytes and gateway.max_schema_nodes before any engine compiles them into a grammar: that compile
grows with their size (one 2 MiB JSON-schema ``enum`` held an engine for 37.5 s). Pure; no I/O."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pdserve.errors import BadRequest

_CODE = "structured_output_too_large"


def check_schemas(body: Mapping[str, Any], *, max_bytes: int, max_nodes: int) -> None:
    """Raises BadRequest (400, ``param`` naming the field) when one schema is longer than ``max_bytes`` as compact
    JSON, or when the request's schemas together hold more than ``max_nodes`` JSON values. Each is walked
    iteratively and no further than its limits, so neither a deep nor a huge schema costs more than they allow."""
    nodes_left = max_nodes
    for param, schema in _schemas(body):
        nodes, size = _measure(schema, max_nodes=nodes_left, max_bytes=max_bytes)
        if nodes > nodes_left:
            raise BadRequest(f"the request's structured-output schemas hold more than {max_nodes} JSON values "
                             f"(gateway.max_schema_nodes), counted up to {param}", param=param, code=_CODE)
        if size > max_bytes:
            raise BadRequest(f"{param} is longer than the {max_bytes} bytes a structured-output schema may be as JSON "
                             "(gateway.max_schema_bytes)", param=param, code=_CODE)
        nodes_left -= nodes


def _schemas(body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each structured-output field of a validated body, by its param path."""
    for name in ("response_format", "structured_outputs"):
        if body.get(name) is not None:
            yield name, body[name]
    for index, tool in enumerate(body.get("tools") or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("parameters") is not None:
            yield f"tools.{index}.function.parameters", function["parameters"]


def _measure(value: Any, *, max_nodes: int, max_bytes: int) -> tuple[int, int]:
    """The JSON values in ``value`` (itself, each member and item, nested) and its length as compact JSON (a
    string's escapes aside), counted until either passes its max."""
    nodes = size = 0
    stack = [value]
    while stack and nodes <= max_nodes and size <= max_bytes:
        node = stack.pop()
        nodes += 1
        if isinstance(node, dict):  # braces, and each member's quoted key, colon and comma
            size += 1 + sum(len(key) + 4 for key in node)
            stack.extend(node.values())
        elif isinstance(node, list):  # brackets and commas
            size += 1 + len(node)
            stack.extend(node)
        else:  # a string's quotes, or a number, true, false or null
            size += len(node) + 2 if isinstance(node, str) else len(str(node))
    return nodes, size
