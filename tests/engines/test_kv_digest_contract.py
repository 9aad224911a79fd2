"""The vLLM names the KV integrity check relies on (pdserve_vllm/contract.py, hook kv_integrity.py) hold in every
supported release with a failed pull by request (0.30 on), and a release where one changed is refused naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve_vllm.contract import CONTRACT, Hook
from pdserve_vllm.contract_check import ContractBroken, problems, require
from tests.engines.test_vllm_contract import CHECKED_RELEASES
from tests.engines.vllm_sources import release_source

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@pytest.mark.parametrize("version", CHECKED_RELEASES)
def test_the_integrity_checks_names_hold_in_each_release(version: str) -> None:
    names = [entry for entry in CONTRACT if entry.hook is Hook.KV_INTEGRITY]
    assert names and problems(names, source_root=release_source(version), version=version) == []


@pytest.mark.parametrize(("path", "old", "new", "named"), [
    pytest.param(SCHEDULER, "self._update_from_kv_xfer_finished(kv_connector_output)",
                 "self._update_from_kv_xfer_finished(output)", "Scheduler.update_from_output", id="order"),
    pytest.param(SCHEDULER, "self.failed_recving_kv_req_ids.add(req_id)", "pass",
                 "Scheduler._handle_failed_recving", id="recompute"),
    pytest.param(BASE, "def build_connector_worker_meta(self)", "def build_worker_meta(self)",
                 "KVConnectorBase_V1.build_connector_worker_meta", id="worker-meta"),
])
def test_a_release_that_changed_one_is_refused_naming_it(path: str, old: str, new: str, named: str,
                                                          tmp_path: Path) -> None:
    copy = tmp_path / "vllm-copy"
    shutil.copytree(release_source("0.34.0"), copy)
    text = (copy / path).read_text()
    assert old in text, f"{old!r} is not in {path}: the mutation no longer applies"
    (copy / path).write_text(text.replace(old, new))
    with pytest.raises(ContractBroken, match=named.replace(".", r"\.")):
        require(Hook.KV_INTEGRITY, source_root=copy, version="0.34.0")
