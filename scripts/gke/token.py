"""`multislice gke-token`: the exec credential plugin of a GKE stack's Kubernetes provider.

Prints one ExecCredential (client.authentication.k8s.io/v1beta1) with a fresh access token of
the deployer's Application Default Credentials and its expiry, as client-go's exec plugin
protocol asks ("client-go credential plugins" in the Kubernetes docs): pulumi-kubernetes runs it
whenever it needs a token, so no token is kept in the stack's state (infra/gke/resources.py).
Exit 1 with one line on stderr (which client-go shows) when no credentials can be had.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC
from typing import Any

from scripts.gke.cluster import SCOPES

API_VERSION = "client.authentication.k8s.io/v1beta1"


def exec_credential(credentials: Any) -> dict[str, Any]:
    """The ExecCredential for refreshed google-auth `credentials`."""
    status: dict[str, Any] = {"token": credentials.token}
    if credentials.expiry is not None:  # google-auth's expiry is naive UTC
        status["expirationTimestamp"] = (
            credentials.expiry.replace(tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return {"apiVersion": API_VERSION, "kind": "ExecCredential", "status": status}


MAX_CREDENTIALS_BYTES = 1 << 20  # an ADC file is a few kB


def credential_file_problem() -> str | None:
    """What is wrong with a credentials file google-auth would read, before it reads it: a FIFO,
    a device or a directory would hang or crash it; a huge file is no credentials file."""
    import os
    import stat
    from pathlib import Path

    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    config = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    for label, path in (("GOOGLE_APPLICATION_CREDENTIALS", named),
                        ("the gcloud credentials file",
                         str(config / "application_default_credentials.json"))):
        if not path:
            continue
        try:
            info = os.stat(path)
        except OSError:
            if label == "GOOGLE_APPLICATION_CREDENTIALS":
                return f"{label}={path}: no such file; point it at a service account key or " \
                       "run `gcloud auth application-default login` and unset it"
            continue
        if not stat.S_ISREG(info.st_mode):
            return f"{label} {path} is not a regular file (a pipe, device or directory); " \
                   "replace it with the JSON credentials file"
        if info.st_size > MAX_CREDENTIALS_BYTES:
            return f"{label} {path} is {info.st_size:,} bytes, not a credentials file (a few kB)"
    return None


def fresh_credentials() -> Any:
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=SCOPES)
    credentials.refresh(google.auth.transport.requests.Request())
    return credentials


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gke-token",
        help="a Kubernetes exec credential from your Google credentials (for pulumi-kubernetes)",
        description="Print one Kubernetes ExecCredential with a fresh access token of your "
        "Google application-default credentials and its expiry. A GKE stack's Kubernetes "
        "provider runs this whenever it needs a token, so none is kept in the stack's state.")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    problem = credential_file_problem()
    if problem is not None:
        print(f"multislice gke-token: {problem}", file=sys.stderr)
        return 1
    try:
        credentials = fresh_credentials()
    except Exception as exc:  # no ADC, a refused refresh, no network: one line
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"multislice gke-token: cannot get a Google access token ({type(exc).__name__}: "
              f"{first}); run `gcloud auth application-default login`, or set "
              "GOOGLE_APPLICATION_CREDENTIALS", file=sys.stderr)
        return 1
    if not isinstance(credentials.token, str) or not credentials.token.strip():
        print("multislice gke-token: the Google credentials gave an empty access token; run "
              "`gcloud auth application-default login` again", file=sys.stderr)
        return 1
    print(json.dumps(exec_credential(credentials)))
    return 0
