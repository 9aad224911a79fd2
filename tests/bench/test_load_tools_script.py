"""`bench/load_tools.sh` points at documentation that exists and, by default, writes where git does not look."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "bench" / "load_tools.sh"


def test_the_doc_it_names_exists() -> None:
    named = re.findall(r"See (docs/[\w./-]+\.md)", SCRIPT.read_text(encoding="utf-8"))
    assert named and all((REPO / path).is_file() for path in named)


def test_by_default_it_writes_under_git_ignored_pdserve_not_the_committed_results(tmp_path: Path) -> None:
    # Nothing listens on port 9: the script makes its folders, finds no gateway and exits 1.
    done = subprocess.run(["bash", str(SCRIPT), "http://127.0.0.1:9"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, timeout=60)
    assert done.returncode == 1 and "does not answer" in done.stderr
    assert (tmp_path / ".pdserve" / "load-tools" / "vllm-bench-serve").is_dir()
    assert not (tmp_path / "docs").exists()
    ignored = subprocess.run(["git", "check-ignore", "-q", ".pdserve/load-tools/summary.txt"], cwd=REPO, check=False)
    assert ignored.returncode == 0
