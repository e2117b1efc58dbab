"""The `multislice` command line: one thin module per command, helpers in packages by concern."""

from infra import PROJECT_ROOT

__all__ = ["PROJECT_ROOT"]
