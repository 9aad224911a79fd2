"""The one ``Role`` enum: which phase of inference an engine or a leg serves."""

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
