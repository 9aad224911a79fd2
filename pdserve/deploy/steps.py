"""What a deployment plan is made of: steps, each one command plus the checks that make it safe to re-run.

Data only: ``eks.py`` builds plans from these, ``runner.py`` executes or prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
class Fallback:
    """A step that may fail in one place for a cause another place may not have (no capacity for an instance
    type in one zone), and the other places to try.

    ``tries`` are (where, stdin) in order; the step's own stdin is the first. After a failed try, ``explain``
    (read-only commands) tell more, and ``cause`` reads their output with the command's: '' when the failure
    is of another kind (the plan stops, as for any step), else the cause in words. Then ``undo`` removes what
    the failed try left, and the next try runs. ``about`` says, for the dry run and the last error, what
    kind of failure moves on and why it happens; ``fix`` what to do when every try failed so."""

    tries: tuple[tuple[str, str], ...]
    explain: tuple[tuple[str, ...], ...]
    cause: Callable[[str], str]
    undo: tuple[str, ...]
    about: str
    fix: str


@dataclass(frozen=True, slots=True)
class Step:
    """One command of a plan.

    ``done_check`` exits 0 when the work is already done (a re-run skips the step); where exiting 0
    is not enough (a node group that exists but failed), ``done_when`` judges its output. ``only_if``
    exits non-zero when there is nothing to do (a removal of something already gone); where exiting 0
    is not enough, ``run_when`` reads its output and returns why the step runs ('' = nothing to do), and a
    failing ``only_if`` then stops the plan instead of skipping (a removal must not run on a guess). Empty = no
    check: the command is idempotent by itself. ``stdin`` carries configs and manifests, so the
    plan needs no files; when ``is_stdin_secret`` it is never shown. ``check_output`` reads the
    command's output and returns what is wrong with it ('' when nothing); ``check_outputs`` does the same
    from the outputs of this and every earlier step of the plan, by step name (a check that compares two
    lookups). ``fix`` says what to do when the command itself fails, under its error; ``causes`` reads the
    failed command's output (stdout and stderr) and returns one line per known cause with what to do.
    """

    name: str
    argv: tuple[str, ...]
    done_check: tuple[str, ...] = ()
    done_when: Callable[[str], Readiness] | None = None
    only_if: tuple[str, ...] = ()
    run_when: Callable[[str], str] | None = None
    stdin: str = ""
    is_stdin_secret: bool = False
    poll: Poll | None = None
    check_output: Callable[[str], str] | None = None
    check_outputs: Callable[[Mapping[str, str]], str] | None = None
    fix: str = ""
    causes: Callable[[str], str] | None = None
    fallback: Fallback | None = None
    about: str = ""  # what the step checks or why it runs, for the dry run

    @property
    def tools(self) -> set[str]:
        """Executables this step runs, its checks included."""
        fallback = (self.fallback.undo, *self.fallback.explain) if self.fallback else ()
        return {argv[0] for argv in (self.argv, self.done_check, self.only_if, *fallback) if argv}
