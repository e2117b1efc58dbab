"""How the Pulumi CLI starts a Python program and a Python dynamic provider, without the CLI.

Facts read from pulumi/pulumi (commit 1b59498, 2026-08):
- pkg/engine/project.go getPwdMain: the program directory is the project root, or root/main when
  ``main`` names a directory (the directory of ``main`` when it names a file).
- sdk/python/toolchain ResolveToolchain: the language host resolves a relative ``virtualenv``
  against the project root.
- sdk/go/common/resource/plugin/provider_plugin.go: a resource plugin is spawned in the program
  directory (``ctx.Pwd``) with every runtime option as ``PULUMI_RUNTIME_<OPTION>``, plus
  ``PULUMI_PROJECT`` and ``PULUMI_CONFIG``.
- sdk/python/dist/pulumi-resource-pulumi-python: the dynamic provider makes a relative
  ``PULUMI_RUNTIME_VIRTUALENV`` absolute against ``$PWD`` and runs
  ``$VENV/bin/python -u -m pulumi.dynamic ARGS``, or exits 1 when ``$VENV/bin/python`` is missing.
- sdk/python/cmd/pulumi-language-python-exec: the program's config arrives as ``PULUMI_CONFIG``
  (JSON) and is loaded with ``set_all_config`` before the program runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml


class EngineContractError(RuntimeError):
    """The CLI would fail to start the program or the provider; the message says why."""


@dataclass(frozen=True)
class Project:
    root: Path
    name: str
    main: str
    options: dict[str, str]

    @classmethod
    def load(cls, root: Path) -> Project:
        doc = yaml.safe_load((root / "Pulumi.yaml").read_text())
        runtime = doc.get("runtime") or {}
        options = runtime.get("options") or {} if isinstance(runtime, dict) else {}
        return cls(root=root, name=doc["name"], main=str(doc.get("main") or ""),
                   options={k: str(v) for k, v in options.items()})

    @property
    def program_directory(self) -> Path:
        if not self.main:
            return self.root
        main = (self.root / self.main).resolve()
        if not main.exists():
            raise EngineContractError(f"project 'main' could not be read: {main}")
        return main if main.is_dir() else main.parent

    def language_host_virtualenv(self) -> Path | None:
        venv = self.options.get("virtualenv")
        if not venv:
            return None
        return Path(venv) if Path(venv).is_absolute() else self.root / venv

    def provider_environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PULUMI_", "PYTHON"))}
        env.update({f"PULUMI_RUNTIME_{k.upper()}": v for k, v in self.options.items()})
        env["PULUMI_PROJECT"] = self.name
        env.update(extra or {})
        return env

    def dynamic_provider_python(self, env: dict[str, str]) -> Path:
        """The interpreter pulumi-resource-pulumi-python would run, from its working directory."""
        venv = env.get("PULUMI_RUNTIME_VIRTUALENV", "")
        if not venv and env.get("PULUMI_RUNTIME_TOOLCHAIN") == "uv":
            venv = ".venv"
        if not venv:
            raise EngineContractError("no virtualenv option: the provider would run python3 "
                                      "from PATH, without this project's packages")
        path = Path(venv.rstrip("/"))
        if not path.is_absolute():
            path = self.program_directory / path
        if not (path / "bin" / "python").is_file():
            raise EngineContractError(
                f"The 'virtualenv' option in Pulumi.yaml is set to {str(path)!r}, but "
                f"{str(path)!r} doesn't exist (the dynamic provider resolves it against its "
                f"working directory {self.program_directory})")
        return path / "bin" / "python"

    def start_dynamic_provider(self, extra_env: dict[str, str] | None = None) -> tuple[
            subprocess.Popen[str], int]:
        """(process, gRPC port) of the Python dynamic provider, started as the engine does."""
        env = self.provider_environment(extra_env)
        python = self.dynamic_provider_python(env)
        proc = subprocess.Popen(
            [str(python), "-u", "-m", "pulumi.dynamic", "127.0.0.1:1"],
            cwd=self.program_directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.isdigit():
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise EngineContractError(f"the dynamic provider did not start: {err.strip()[-800:]}")
        return proc, int(line)

    def program_environment(self, config: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PULUMI_", "PYTHON"))}
        env["PULUMI_CONFIG"] = json.dumps(config)
        return env
