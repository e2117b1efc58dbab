"""argparse `type=` validators shared by the commands: each error names what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class UsageError(ValueError):
    """An argument that cannot work; the message says what was given and what is allowed."""


def whole_number(minimum: int) -> Callable[[str], int]:
    """An int >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return parse


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """A duration in seconds: >= 0 when allow_zero, else > 0."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of seconds {bound}, got {text!r}") from None
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {value:g}")
        return value

    return parse


positive_int = whole_number(1)
non_negative_int = whole_number(0)
positive_seconds = seconds(allow_zero=False)
non_negative_seconds = seconds(allow_zero=True)
