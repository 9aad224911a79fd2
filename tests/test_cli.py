"""The command line as a user meets it: bad configuration stops everything before any start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pdserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, check=False)


def test_up_with_a_bad_config_exits_2_naming_fields_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("gateway: {port: eighty}\ndecode: {engines: -1}\n")
    result = pdserve("up", "--config", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "gateway.port" in result.stderr and "decode.engines" in result.stderr
    assert not (tmp_path / ".pdserve").exists(), "no engine log: nothing was started"


def test_config_example_validates(tmp_path: Path) -> None:
    example = pdserve("config", "example", cwd=tmp_path)
    (tmp_path / "example.yaml").write_text(example.stdout)
    result = pdserve("config", "validate", "example.yaml", cwd=tmp_path)
    assert result.returncode == 0 and "valid (prefill-0 :8100, decode-0 :8200; gateway :8000)" in result.stdout


def test_bench_compare_with_an_unknown_way_exits_2_before_any_start(tmp_path: Path) -> None:
    result = pdserve("bench", "compare", "--ways", "aggregated,sideways", cwd=tmp_path)
    assert result.returncode == 2 and "direct,aggregated,disaggregated" in result.stderr
    assert not (tmp_path / ".pdserve").exists()
