"""argparse `type=` validators shared by the commands: each error names what was expected."""

from __future__ import annotations

import argparse
import math
import sys
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
    """A duration in seconds: finite, >= 0 when allow_zero, else > 0 (NaN and infinity are
    refused: float() takes them, and every comparison with NaN is false)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of seconds {bound}, got {text!r}") from None
        if not math.isfinite(value):
            no_limit = " (0 means no limit where a flag allows it)" if allow_zero else ""
            raise argparse.ArgumentTypeError(
                f"expected a finite number of seconds {bound}, got {text!r}{no_limit}")
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {value:g}")
        return value

    return parse


positive_int = whole_number(1)
non_negative_int = whole_number(0)
positive_seconds = seconds(allow_zero=False)
non_negative_seconds = seconds(allow_zero=True)


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {low} to {high}, got {value}")
        return value

    return parse


def mesh_axis(text: str) -> int:
    """A mesh axis size: a positive whole number, or -1 (fill in the rest of its group)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive whole number or -1, got {text!r}") from None
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number or -1, got {value}")
    return value


def fraction(*, allow_zero: bool, allow_one: bool) -> Callable[[str], float]:
    """A share between 0 and 1 (each end included only when allowed)."""
    low, high = ("[" if allow_zero else "("), ("]" if allow_one else ")")
    shown = f"{low}0, 1{high}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {shown}, got {text!r}") from None
        if not (0 < value < 1 or (allow_zero and value == 0) or (allow_one and value == 1)):
            raise argparse.ArgumentTypeError(f"expected a number in {shown}, got {value:g}")
        return value

    return parse


port = int_range(1, 65535)


def report_error(command: str, message: object) -> None:
    """The one error line every command prints: `multislice COMMAND: error: MESSAGE`, as argparse."""
    print(f"multislice {command}: error: {message}", file=sys.stderr)
