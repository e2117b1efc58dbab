"""The deployer's Google credentials, as pulumi-gcp finds them: its environment variables (a
key's JSON or its path, or an access token), else application-default credentials, impersonating
GOOGLE_IMPERSONATE_SERVICE_ACCOUNT when set. One definition for everything that acts as the
deployer outside pulumi-gcp: the Kubernetes provider's exec credential (`multislice gke-token`),
the preview's check of an existing cluster (infra/gke/cluster_check.py) and the CLI's reads of
a cluster (`status`, `queue`, `babysit`), so none of them authenticates as someone else.
"""

from __future__ import annotations

import json
from typing import Any

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
CREDENTIALS_ENV = ("GOOGLE_CREDENTIALS", "GOOGLE_CLOUD_KEYFILE_JSON", "GCLOUD_KEYFILE_JSON")
ACCESS_TOKEN_ENV = "GOOGLE_OAUTH_ACCESS_TOKEN"
IMPERSONATE_ENV = "GOOGLE_IMPERSONATE_SERVICE_ACCOUNT"


def google_credentials() -> tuple[Any, str]:
    """The deployer's Google credentials, unrefreshed, and where they came from: pulumi-gcp's
    variables first (a key's JSON or its path, or an access token), then application-default
    credentials; impersonating GOOGLE_IMPERSONATE_SERVICE_ACCOUNT when set, as pulumi-gcp does.
    (`gcp:credentials` in the stack's config is not seen here: README says so.)"""
    import os
    from pathlib import Path

    import google.auth
    import google.oauth2.credentials

    credentials: Any = None
    source = "application-default credentials"
    if os.environ.get(ACCESS_TOKEN_ENV):
        credentials = google.oauth2.credentials.Credentials(os.environ[ACCESS_TOKEN_ENV])
        source = ACCESS_TOKEN_ENV
    else:
        for name in CREDENTIALS_ENV:
            value = os.environ.get(name, "").strip()
            if not value:
                continue
            text = value if value.startswith("{") else Path(value).read_text()
            credentials, _ = google.auth.load_credentials_from_dict(json.loads(text),
                                                                    scopes=SCOPES)
            source = name
            break
    if credentials is None:
        credentials, _ = google.auth.default(scopes=SCOPES)
    target = os.environ.get(IMPERSONATE_ENV, "").strip()
    if target:
        from google.auth import impersonated_credentials

        credentials = impersonated_credentials.Credentials(
            source_credentials=credentials, target_principal=target,
            target_scopes=list(SCOPES))
        source = f"{source}, impersonating {target}"
    return credentials, source


def fresh_credentials() -> Any:
    import google.auth.transport.requests

    credentials, source = google_credentials()
    if source != ACCESS_TOKEN_ENV:  # a bare access token is used as given: it cannot refresh
        credentials.refresh(google.auth.transport.requests.Request())
    return credentials


class CredentialsError(Exception):
    """No usable Google credentials: one line naming where they were looked for."""


def deployer_credentials() -> Any:
    """fresh_credentials with every failure (none found, an unreadable key, a refused refresh)
    as one CredentialsError line."""
    try:
        return fresh_credentials()
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CredentialsError(
            f"no usable Google credentials ({type(exc).__name__}: {first}); set one of "
            f"{', '.join(CREDENTIALS_ENV)} or {ACCESS_TOKEN_ENV} as for pulumi-gcp, or run "
            "`gcloud auth application-default login`") from None
