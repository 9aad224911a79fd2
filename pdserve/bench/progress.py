"""The terminal progress bar of a benchmark (rich): one line per target and load level."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import OnDone


@contextmanager
def request_bar(label: str, total: int | None) -> Iterator[OnDone]:
    """A bar that advances once per finished request and counts errors; ``total=None`` just counts."""
    columns = (SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(label, total=total, errors=0)
        errors = 0

        def on_done(record: RequestRecord) -> None:
            nonlocal errors
            errors += record.error is not None
            progress.update(task, advance=1, errors=errors)

        yield on_done
