"""What a deployment plan is made of: steps, each one command plus the checks that make it safe to re-run.

Data only: ``eks.py`` builds plans from these, ``runner.py`` executes or prints them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Readiness:
    """One look at something that takes a while to come up: is it there yet, and where it stands.

    ``blocker`` is set when it cannot come up by itself (no node offers a resource the pods need, an
    image that cannot be pulled): the cause and its fix, and the plan stops at once instead of waiting."""

    is_ready: bool
    summary: str
    blocker: str = ""


@dataclass(frozen=True, slots=True)
class Poll:
    """Repeat a step's command every ``interval_s`` until ``check(stdout)`` says ready, for at most
    ``timeout_s``; a failing command counts as "not yet" (the object may not exist yet)."""

    check: Callable[[str], Readiness]
    timeout_s: float
    interval_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Step:
    """One command of a plan.

    ``done_check`` exits 0 when the work is already done (a re-run skips the step); where exiting 0
    is not enough (a node group that exists but failed), ``done_when`` judges its output. ``only_if``
    exits non-zero when there is nothing to do (a removal of something already gone). Empty = no
    check: the command is idempotent by itself. ``stdin`` carries configs and manifests, so the
    plan needs no files; when ``is_stdin_secret`` it is never shown. ``check_output`` reads the
    command's output and returns what is wrong with it ('' when nothing).
    """

    name: str
    argv: tuple[str, ...]
    done_check: tuple[str, ...] = ()
    done_when: Callable[[str], Readiness] | None = None
    only_if: tuple[str, ...] = ()
    stdin: str = ""
    is_stdin_secret: bool = False
    poll: Poll | None = None
    check_output: Callable[[str], str] | None = None
    about: str = ""  # what the step checks or why it runs, for the dry run

    @property
    def tools(self) -> set[str]:
        """Executables this step runs, its checks included."""
        return {argv[0] for argv in (self.argv, self.done_check, self.only_if) if argv}
