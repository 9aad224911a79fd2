"""The load generator's targets: pdserve's engines get the engine key, any other target never does."""

from __future__ import annotations

import pytest

from pdserve.bench import runner
from pdserve.bench.workload import BenchRequest
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine

ENGINE_KEY_HEADERS = {"Authorization": "Bearer engine-key-for-bench-0123"}


async def test_an_engine_target_sends_the_engine_key_over_the_client_key_and_a_plain_target_only_the_client_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runner.CLIENT_KEY_ENV, "client-key-0123456789")
    engine = FakeEngine()
    request = BenchRequest("/v1/completions", {"model": "pdserve-demo", "prompt": "hi", "max_tokens": 2,
                                               "stream": True})
    async with serving(engine.app(), free_port()) as url, runner.new_session() as session:
        for target in (runner.Target.parse(f"engines={url}", headers=ENGINE_KEY_HEADERS),
                       runner.Target.parse(f"gateway={url}")):
            records = await runner.run_open_loop(session, target, [request], [0.0], timeout_s=10,
                                                 on_done=lambda _record: None)
            assert records[0].error is None
    assert [headers["authorization"] for headers in engine.headers] == [
        ENGINE_KEY_HEADERS["Authorization"], "Bearer client-key-0123456789"]
