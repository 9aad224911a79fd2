"""Execute (or only print) a plan of steps with subprocesses: the I/O edge of ``pdserve cloud``.

Knows nothing of EKS: it runs each step's checks and command, prints one progress line per
change, and stops at the first failure with the step's name, command and output (stdout too: eksctl
writes all but its last line there), and the causes the step reads in it.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from pdserve.deploy.steps import Fallback, Poll, Readiness, Step
from pdserve.errors import DeployError

Progress = Callable[[str], None]

TOOL_SOURCES = {
    "aws": "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html",
    "eksctl": "https://eksctl.io/installation/",
    "helm": "https://helm.sh/docs/intro/install/",
    "kubectl": "https://kubernetes.io/docs/tasks/tools/",
}
CHECK_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 3600.0  # creating or deleting an EKS cluster takes many minutes; a hang does not last forever
HEARTBEAT_S = 30.0
_OUTPUT_TAIL_LINES = 20
# eksctl's critical and warning lines (kris-nova/logger's icons, eksctl cmd/eksctl/logger.go:57-80), CloudFormation's
# failed resources among them (pkg/cfn/manager/waiters.go:42-52): kept from anywhere in a long stdout
_KEPT_MARKS = ("[✖]", "[!]", "CREATE_FAILED", "DELETE_FAILED")


def plan_tools(steps: Iterable[Step]) -> set[str]:
    return set().union(*(step.tools for step in steps))


def missing_tools(tools: Iterable[str]) -> str:
    """'' when every tool is on PATH; else one line per missing tool and where to get it."""
    return "\n".join(f"  {tool}: not on PATH; install it from {TOOL_SOURCES.get(tool, 'its vendor')}"
                     for tool in sorted(tools) if shutil.which(tool) is None)


def require_tools(tools: Iterable[str]) -> None:
    """Raise DeployError naming every missing tool, before any of them runs."""
    missing = missing_tools(tools)
    if missing:
        raise DeployError(f"pdserve cloud needs these command-line tools:\n{missing}")


def run_plan(steps: Sequence[Step], *, progress: Progress) -> dict[str, str]:
    """Run ``steps`` in order, skipping those whose checks say so. Raises DeployError at the first
    failing step; the ones before it are done, so running the plan again resumes there. Returns the
    output of each step that ran a command once (not a wait), by step name."""
    require_tools(plan_tools(steps))
    outputs: dict[str, str] = {}
    for index, step in enumerate(steps, start=1):
        label = _label(step, index=index, total=len(steps))
        if _is_done(step):
            progress(f"{label} skipped (already done)")
            continue
        if step.only_if and not _has_work(step, label=label, progress=progress):
            progress(f"{label} skipped (nothing to do)")
            continue
        progress(f"{label} running: {shlex.join(step.argv)}")
        started_s = time.monotonic()
        if step.poll is not None:
            _wait_until_ready(step, step.poll, label=label, progress=progress)
        elif step.fallback is not None:
            outputs[step.name] = _execute_with_fallback(step, step.fallback, label=label, progress=progress)
        else:
            outputs[step.name] = _execute(step, label=label, progress=progress)
        problem = step.check_outputs(outputs) if step.check_outputs and step.name in outputs else ""
        if problem:
            raise DeployError(f"step {step.name}: {problem}")
        progress(f"{label} done {time.monotonic() - started_s:.1f}s")
    return outputs


def print_plan(steps: Sequence[Step], *, progress: Progress) -> None:
    """Every command in order, with its checks and its input (secrets hidden); runs nothing."""
    shown: dict[str, str] = {}
    for index, step in enumerate(steps, start=1):
        label = _label(step, index=index, total=len(steps))
        indent = " " * (len(label) + 1)
        progress(f"{label} {shlex.join(step.argv)}")
        if step.about:
            progress(f"{indent}{step.about}")
        if step.done_check:
            judged = " and its output says done" if step.done_when else ""
            progress(f"{indent}skipped when this succeeds{judged}: {shlex.join(step.done_check)}")
        if step.only_if:
            finds = "finds work to do" if step.run_when else "succeeds"
            progress(f"{indent}run only if this {finds}: {shlex.join(step.only_if)}")
        if step.fallback is not None:
            _print_fallback(step.fallback, indent=indent, progress=progress)
        if step.poll is not None:
            progress(f"{indent}repeated every {step.poll.interval_s:.0f}s until ready, "
                     f"at most {step.poll.timeout_s:.0f}s")
        if step.is_stdin_secret:
            progress(f"{indent}stdin: (secret, not shown)")
        elif step.stdin in shown:
            progress(f"{indent}stdin: the same as step {shown[step.stdin]}")
        elif step.stdin:
            shown[step.stdin] = step.name
            progress(f"{indent}stdin:")
            progress("\n".join(f"{indent}  {line}" for line in step.stdin.rstrip("\n").splitlines()))
    missing = missing_tools(plan_tools(steps))
    if missing:
        progress(f"warning: `up`/`down` without --dry-run would stop here:\n{missing}")


def capture(argv: Sequence[str], *, what: str, timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """The stdout of a read-only command; raises DeployError naming ``what`` it was for."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"{what}: {shlex.join(argv)} did not finish in {timeout_s:.0f}s") from exc
    if result.returncode != 0:
        raise DeployError(_failure(what, argv, result.returncode, stdout=result.stdout, stderr=result.stderr))
    return result.stdout


def _has_work(step: Step, *, label: str, progress: Progress) -> bool:
    """Whether ``only_if`` (and ``run_when`` on its output, said before the step runs) finds work to do."""
    if step.run_when is None:
        return _succeeds(step.only_if)
    reason = step.run_when(capture(step.only_if, what=f"step {step.name}'s check"))
    if reason:
        progress(f"{label} {reason}")
    return bool(reason)


def _is_done(step: Step) -> bool:
    """Whether ``done_check`` (and ``done_when`` on its output) says the step's work is done; a
    state that a re-run cannot fix (a node group that failed to create) stops the plan."""
    if not step.done_check:
        return False
    if step.done_when is None:
        return _succeeds(step.done_check)
    try:
        output = capture(step.done_check, what=f"step {step.name}'s check")
    except DeployError:
        return False
    verdict = step.done_when(output)
    if verdict.blocker:
        raise DeployError(f"step {step.name}: {verdict.blocker}")
    return verdict.is_ready


def _label(step: Step, *, index: int, total: int) -> str:
    return f"[{index:>{len(str(total))}}/{total}] {step.name:<18}"


def _succeeds(argv: Sequence[str]) -> bool:
    try:
        result = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=CHECK_TIMEOUT_S,
                                check=False)
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"check {shlex.join(argv)} did not answer in {CHECK_TIMEOUT_S:.0f}s") from exc
    return result.returncode == 0


def _print_fallback(fallback: Fallback, *, indent: str, progress: Progress) -> None:
    first, *others = [where for where, _ in fallback.tries]
    progress(f"{indent}{first} first; if it fails for {fallback.about}")
    progress(f"{indent}  read why: " + "; ".join(shlex.join(argv) for argv in fallback.explain))
    progress(f"{indent}  remove the failed try: {shlex.join(fallback.undo)}")
    progress(f"{indent}  then try " + (", then ".join(others) if others else "nothing else (no other place is listed)"))


def _execute(step: Step, *, label: str, progress: Progress) -> str:
    """Run the command, feeding ``stdin``; its stdout, or DeployError (with the step's fix) when it fails."""
    returncode, stdout, stderr = _run(step, label=label, progress=progress)
    if returncode != 0:
        fix = f"\n{step.fix}" if step.fix else ""
        raise DeployError(_failure(f"step {step.name}", step.argv, returncode, stdout=stdout, stderr=stderr)
                          + _causes(step, stdout + stderr) + fix)
    return _checked(step, stdout)


def _execute_with_fallback(step: Step, fallback: Fallback, *, label: str, progress: Progress) -> str:
    """Each try in turn while the failure is the kind ``fallback`` moves on from; what a failed try left is
    removed first, so the next starts clean and a re-run of the plan finds nothing half made."""
    causes: list[str] = []
    for number, (where, stdin) in enumerate(fallback.tries):
        attempt = replace(step, stdin=stdin, fallback=None)
        returncode, stdout, stderr = _run(attempt, label=label, progress=progress)
        if returncode == 0:
            return _checked(attempt, stdout)
        failure = _failure(f"step {step.name} ({where})", step.argv, returncode, stdout=stdout, stderr=stderr)
        cause = fallback.cause("\n".join([stdout, stderr, *(_output_of(argv) for argv in fallback.explain)]))
        if not cause:
            before = "".join(f"\n  (before: {line})" for line in causes)
            raise DeployError(failure + before + _causes(step, stdout + stderr))
        causes.append(f"{where}: {cause}")
        progress(f"{label} {where}: {cause}; removing the failed try: {shlex.join(fallback.undo)}")
        _execute(Step(f"{step.name}-undo", fallback.undo), label=label, progress=progress)
        if number + 1 < len(fallback.tries):
            progress(f"{label} trying {fallback.tries[number + 1][0]} instead")
    raise DeployError(f"step {step.name} failed in every place it may use, for {fallback.about}:\n"
                      + "\n".join(f"  {line}" for line in causes) + f"\n{fallback.fix}")


def _causes(step: Step, output: str) -> str:
    """The known causes ``step.causes`` reads in a failed command's output, on lines of their own ('' for none)."""
    found = step.causes(output) if step.causes else ""
    return f"\n{found}" if found else ""


def _checked(step: Step, stdout: str) -> str:
    """``stdout``, once ``check_output`` finds nothing wrong with it."""
    problem = step.check_output(stdout) if step.check_output else ""
    if problem:
        raise DeployError(f"step {step.name}: {problem}")
    return stdout


def _output_of(argv: Sequence[str]) -> str:
    """What a read-only command says, its errors included ('' when it does not answer in time)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return ""
    return result.stdout + result.stderr


def _run(step: Step, *, label: str, progress: Progress) -> tuple[int, str, str]:
    """Run the command, feeding ``stdin``; a heartbeat line while it takes long (eksctl: minutes)."""
    started_s = time.monotonic()
    with subprocess.Popen(step.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        while True:
            try:
                # communicate() may be called again after a timeout; the input is sent only once
                stdout, stderr = process.communicate(step.stdin, timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                elapsed_s = time.monotonic() - started_s
                if elapsed_s > STEP_TIMEOUT_S:
                    process.kill()
                    raise DeployError(f"step {step.name} did not finish in {STEP_TIMEOUT_S:.0f}s: "
                                      f"{shlex.join(step.argv)}") from None
                progress(f"{label} still running ({elapsed_s:.0f}s)")
    return process.returncode, stdout, stderr


def _wait_until_ready(step: Step, poll: Poll, *, label: str, progress: Progress) -> None:
    started_s = time.monotonic()
    while True:
        readiness = _look(step.argv, poll)
        elapsed_s = time.monotonic() - started_s
        if readiness.is_ready:
            progress(f"{label} ready: {readiness.summary}")
            return
        if readiness.blocker:
            raise DeployError(f"step {step.name}: {readiness.blocker}\n(where it stood after {elapsed_s:.0f}s: "
                              f"{readiness.summary})")
        if elapsed_s > poll.timeout_s:
            raise DeployError(f"step {step.name}: not ready after {poll.timeout_s:.0f}s "
                              f"({readiness.summary}); `pdserve cloud status` shows where it stands")
        progress(f"{label} waiting {elapsed_s:.0f}s: {readiness.summary}")
        time.sleep(poll.interval_s)


def _look(argv: Sequence[str], poll: Poll) -> Readiness:
    """One poll; a failing or hanging command is "not yet", summarised by its last stderr line."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Readiness(is_ready=False, summary=f"no answer in {CHECK_TIMEOUT_S:.0f}s")
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        return Readiness(is_ready=False, summary=last)
    return poll.check(result.stdout)


def _failure(what: str, argv: Sequence[str], returncode: int, *, stdout: str, stderr: str) -> str:
    """The failed command, then what it said: stdout's critical lines and tail, then stderr's tail."""
    out, err = stdout.strip().splitlines(), stderr.strip().splitlines()
    tail = out[-_OUTPUT_TAIL_LINES:]
    kept = [line for line in out[:-_OUTPUT_TAIL_LINES] if any(mark in line for mark in _KEPT_MARKS)]
    shown = "\n".join(f"  {line}" for line in [*kept, *tail, *err[-_OUTPUT_TAIL_LINES:]])
    return f"{what} failed (exit {returncode}): {shlex.join(argv)}" + (f"\n{shown}" if shown else "")
