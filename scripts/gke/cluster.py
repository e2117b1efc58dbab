"""A Kubernetes API client for a GKE stack's cluster, from the deployer's Google credentials.

The cluster's endpoint and CA come from the GKE API (projects.locations.clusters.get), the bearer
token from Application Default Credentials, refreshed as it expires: no kubeconfig and no
gke-gcloud-auth-plugin, as in the Pulumi program. `MULTISLICE_KUBERNETES_API` (a URL) points the client at another API server
instead, such as `kubectl proxy` or an emulator, as MULTISLICE_TPU_API_ENDPOINT does for the TPU
API; every call after that is the same.
"""

from __future__ import annotations

import base64
import os
import tempfile
from typing import Any

from infra.gke.k8s_names import KUBERNETES_API_ENV

GKE_API = "https://container.googleapis.com/v1"
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


class ClusterError(RuntimeError):
    """The cluster could not be reached or described; the message says which and why."""


class ClusterSettingError(ClusterError):
    """A setting the user gave (MULTISLICE_KUBERNETES_API) is malformed: a usage error."""


def api_url(value: str) -> str:
    """MULTISLICE_KUBERNETES_API as a base URL, or ClusterSettingError naming what is wrong."""
    from urllib.parse import urlsplit

    shown = repr(value) if len(value) <= 80 else f"{value[:80]!r}... ({len(value)} characters)"
    allowed = "use http://HOST:PORT or https://HOST:PORT (a `kubectl proxy`, an API emulator)"
    if len(value) > 2048:
        raise ClusterSettingError(f"{KUBERNETES_API_ENV}={shown} is longer than a URL can be (2048 "
                                  f"characters); {allowed}")
    try:
        parts = urlsplit(value)
        port = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        raise ClusterSettingError(f"{KUBERNETES_API_ENV}={shown} is not a URL ({exc}); {allowed}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or len(parts.hostname) > 253:
        raise ClusterSettingError(f"{KUBERNETES_API_ENV}={shown} is not a URL; {allowed}")
    if any(c.isspace() for c in value) or parts.query or parts.fragment:
        raise ClusterSettingError(f"{KUBERNETES_API_ENV}={shown} holds spaces, a query or a fragment; "
                                  f"{allowed}")
    del port
    return value.rstrip("/")


def api_client(cfg: Any, timeout_s: float = 30.0) -> Any:
    """A kubernetes.client.ApiClient for the stack's cluster."""
    from kubernetes import client

    from infra.gke import manifest as gke_manifest

    conf = client.Configuration()
    url = os.environ.get(KUBERNETES_API_ENV, "").strip()
    if url:
        conf.host = api_url(url)
        return client.ApiClient(conf)
    import google.auth.transport.requests

    from infra.cloud.credentials import google_credentials

    name = (f"projects/{cfg.project}/locations/{gke_manifest.cluster_location(cfg)}/clusters/"
            f"{gke_manifest.cluster_name(cfg)}")
    try:  # the identity pulumi-gcp and the Kubernetes provider use (gke-token)
        credentials, _ = google_credentials()
    except Exception as exc:
        raise ClusterError(f"cannot describe {name}: no Google credentials on this machine "
                           f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}); "
                           "run `gcloud auth application-default login`, or set "
                           "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_CREDENTIALS (or "
                           f"{KUBERNETES_API_ENV} for a `kubectl proxy`)") from None
    try:
        session = google.auth.transport.requests.AuthorizedSession(credentials)
        answer = session.get(f"{GKE_API}/{name}", timeout=timeout_s)
    except Exception as exc:  # no network, a refused token: one line
        raise ClusterError(f"cannot describe {name} with the GKE API: {type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:200]}") from None
    if answer.status_code != 200:
        raise ClusterError(f"the GKE API answered HTTP {answer.status_code} for {name}: "
                           f"{answer.text[:200]}")
    cluster = answer.json()
    ca = tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False)  # noqa: SIM115
    with ca:
        ca.write(base64.b64decode(cluster["masterAuth"]["clusterCaCertificate"]))
    conf.host = f"https://{cluster['endpoint']}"
    conf.ssl_ca_cert = ca.name
    refresh_token_before_each_call(conf, credentials)
    return client.ApiClient(conf)


def refresh_token_before_each_call(conf: Any, credentials: Any) -> None:
    """Bearer auth from google-auth `credentials`, refreshed before any call that would send an
    expired (or nearly expired) token: a `watch` outlives the hour a token lasts."""
    import google.auth.transport.requests

    def refresh(configuration: Any) -> None:
        if not credentials.valid:  # expired, or within google-auth's refresh threshold
            credentials.refresh(google.auth.transport.requests.Request())
        configuration.api_key = {"authorization": credentials.token}

    conf.api_key_prefix = {"authorization": "Bearer"}
    conf.refresh_api_key_hook = refresh
    refresh(conf)
