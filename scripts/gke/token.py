"""`multislice gke-token`: the exec credential plugin of a GKE stack's Kubernetes provider.

Prints one ExecCredential (client.authentication.k8s.io/v1beta1) with a fresh access token of
the deployer's Google credentials (pulumi-gcp's environment variables, else application-default
credentials: the identity pulumi-gcp uses, infra/cloud/credentials.py) and its expiry, as client-go's
exec plugin protocol asks ("client-go credential plugins" in the Kubernetes docs): pulumi-kubernetes runs it
whenever it needs a token, so no token is kept in the stack's state (infra/gke/resources.py).
Exit 1 with one line on stderr (which client-go shows) when no credentials can be had. Run other
than by client-go (no KUBERNETES_EXEC_INFO), it warns on stderr that it prints a bearer token.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC
from typing import Any

from infra.cloud.credentials import fresh_credentials

API_VERSION = "client.authentication.k8s.io/v1beta1"
# client-go sets it in the environment of every exec plugin it runs (the plugin protocol)
EXEC_INFO_ENV = "KUBERNETES_EXEC_INFO"
WARNING = ("multislice gke-token: warning: this prints a bearer token of your Google identity, "
           "valid until its expirationTimestamp; whoever sees it acts as you. It is meant for "
           "pulumi-kubernetes and kubectl, which run it themselves: keep it out of terminals, "
           "logs and CI output")


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


# pulumi-gcp's own credential variables, in its order (its provider docs, "Authentication"): the
# Kubernetes objects are then created by the identity that creates the Google resources.
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
    import os

    if not os.environ.get(EXEC_INFO_ENV):  # run by a person or a script, not by client-go
        print(WARNING, file=sys.stderr)
    print(json.dumps(exec_credential(credentials)))
    return 0
