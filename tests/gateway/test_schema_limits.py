"""Structured-output caps (gateway.max_schema_bytes, max_schema_nodes): a schema too large to compile gets a 400
naming its field before any engine sees it, deep or huge ones are measured without recursion, small ones pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.errors import BadRequest
from pdserve.gateway.schema_limits import check_schemas
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post, ready_gateway_over

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 5}
# What the review sent: a JSON schema whose enum is 2 MiB (37.5 s of grammar compile in the engine).
HUGE_ENUM = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
    "type": "string", "enum": [f"value-{index:07d}" for index in range(2 * 1024 * 1024 // 16)]}}}


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def refusal(body: dict[str, Any], *, max_bytes: int = 64 * 1024, max_nodes: int = 4096) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        check_schemas(body, max_bytes=max_bytes, max_nodes=max_nodes)
    assert refused.value.status == 400 and refused.value.code == "structured_output_too_large"
    return refused.value


def test_each_structured_output_field_is_named_when_too_long() -> None:
    assert refusal({**CHAT, "response_format": HUGE_ENUM}).param == "response_format"
    assert refusal({"structured_outputs": {"regex": "a" * 70_000}}).param == "structured_outputs"
    long_tool = tool({"type": "object", "description": "x" * 70_000})
    assert refusal({**CHAT, "tools": [tool({}), long_tool]}).param == "tools.1.function.parameters"


def test_the_values_of_every_schema_count_together() -> None:
    enum = {"type": "string", "enum": list(range(1500))}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": enum}},
            "tools": [tool(enum), tool(enum)]}
    assert refusal(body).param == "tools.1.function.parameters"  # 4,500 values with the third schema
    check_schemas({**body, "tools": [tool(enum)]}, max_bytes=64 * 1024, max_nodes=4096)  # 3,000 pass


def test_deep_and_wide_schemas_are_measured_without_recursion() -> None:
    deep: dict[str, Any] = {}
    for _ in range(200_000):  # far past any recursion limit
        deep = {"items": deep}
    assert refusal({"structured_outputs": {"json": deep}}).param == "structured_outputs"
    wide = {"structured_outputs": {"json": {"enum": list(range(50))}}}
    assert refusal(wide, max_nodes=20).param == "structured_outputs"
    check_schemas(wide, max_bytes=1024, max_nodes=64)


async def test_a_two_mib_enum_gets_400_before_any_engine_sees_it() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake, max_body_bytes=8 * 1024 * 1024) as base:
        fake.bodies.clear()
        status, payload = await post(base, {**CHAT, "response_format": HUGE_ENUM}, path="/v1/chat/completions")
        schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ["yes", "no"]}}}
        small_status, _ = await post(base, {**CHAT, "response_format": schema}, path="/v1/chat/completions")
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert small_status == 200 and fake.bodies and all(body.get("response_format") == schema for body in fake.bodies)
