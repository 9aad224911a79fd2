"""Gateways on cores of their own, as if each ran on a host of its own.

Whether two gateways serve twice the streams of one can only be shown where the rest of the
benchmark (load generator, synthetic engines) does not take the cores the second gateway needs.
On one machine, giving each gateway its own cores and the other parts the rest stands in for
separate hosts: each gateway's workers (one per core, the gateway's default) run only there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Hosts:
    """Disjoint core sets: one per gateway, and the rest for the other parts."""

    gateways: tuple[frozenset[int], ...]
    rest: frozenset[int]

    @classmethod
    def split(cls, cores: Sequence[int], *, gateways: int, cores_per_gateway: int) -> Hosts:
        """The first ``cores_per_gateway`` of ``cores`` (in order) to gateway 0, the next to gateway 1,
        and so on; at least one core must be left. Raises ConfigError. Pure."""
        ordered = sorted(cores)
        taken = gateways * cores_per_gateway
        if cores_per_gateway < 1 or taken >= len(ordered):
            raise ConfigError(f"{gateways} gateway(s) of {cores_per_gateway} core(s) need more than {taken} cores, "
                              f"with one left for the load generator and synthetic engines; this process may use "
                              f"{len(ordered)}")
        return cls(gateways=tuple(frozenset(ordered[index * cores_per_gateway:(index + 1) * cores_per_gateway])
                                  for index in range(gateways)),
                   rest=frozenset(ordered[taken:]))


@contextlib.contextmanager
def confined(cores: frozenset[int] | None) -> Iterator[None]:
    """This thread on ``cores`` for the block (None: unchanged), so every process it starts runs
    there too; the cores it had are given back after."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
