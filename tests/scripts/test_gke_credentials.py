"""GKE credentials that never expire in state or in a long watch: the exec credential plugin the
Kubernetes provider runs, and the status/watch client's refresh before each call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from scripts.emulators.metadata_server import FakeMetadataServer
from scripts.gke.cluster import refresh_token_before_each_call

REPO = Path(__file__).resolve().parents[2]


def token_env(metadata_host: str, home: Path) -> dict[str, str]:
    """Only the metadata server's credentials: no ADC file, no gcloud config of this machine."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "CLOUDSDK_", "GCE_METADATA"))}
    return {**env, "GCE_METADATA_HOST": metadata_host, "GCE_METADATA_IP": metadata_host,
            "HOME": str(home), "CLOUDSDK_CONFIG": str(home / "gcloud")}


def gke_token(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scripts.cli", "gke-token"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_exec_credential_mints_a_fresh_token_per_call(tmp_path):
    exec_info = '{"kind": "ExecCredential", "spec": {"interactive": false}}'
    with FakeMetadataServer({}, token_lifetime_s=60) as metadata:
        env = token_env(metadata.host, tmp_path)
        first, second = (gke_token({**env, "KUBERNETES_EXEC_INFO": exec_info})
                         for _ in range(2))
        by_hand = gke_token(env)
    for done in (first, second):
        assert done.returncode == 0 and done.stderr == "", done.stderr
    # run by a person, not by client-go: the token still, and one line saying what it is
    assert by_hand.returncode == 0 and json.loads(by_hand.stdout)["status"]["token"]
    (warning,) = by_hand.stderr.splitlines()
    assert warning.startswith("multislice gke-token: warning: this prints a bearer token")
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert one["apiVersion"] == "client.authentication.k8s.io/v1beta1"
    assert one["kind"] == "ExecCredential"
    assert (one["status"]["token"], two["status"]["token"]) == ("ya29.fake-1", "ya29.fake-2")
    assert one["status"]["expirationTimestamp"].endswith("Z")


def test_no_credentials_is_one_line_and_exit_1(tmp_path):
    done = gke_token(token_env("127.0.0.1:9", tmp_path))  # nothing answers there
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("multislice gke-token: cannot get a Google access token")
    assert "gcloud auth application-default login" in line


def test_a_credentials_file_that_is_a_pipe_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "adc.json"
    os.mkfifo(fifo)  # google-auth would block reading it forever
    for env in ({"GOOGLE_APPLICATION_CREDENTIALS": str(fifo)}, {}):
        if not env:  # the gcloud well-known file itself
            (tmp_path / "gcloud").mkdir()
            os.mkfifo(tmp_path / "gcloud" / "application_default_credentials.json")
        done = gke_token({**token_env("127.0.0.1:9", tmp_path), **env})
        assert done.returncode == 1 and done.stdout == ""
        (line,) = done.stderr.strip().splitlines()
        assert "is not a regular file (a pipe, device or directory)" in line, line


def test_an_empty_access_token_is_exit_1_not_an_empty_credential(monkeypatch, capsys):
    from scripts.gke import token

    class Empty:
        token, expiry = "", None

    monkeypatch.setattr(token, "credential_file_problem", lambda: None)
    monkeypatch.setattr(token, "fresh_credentials", Empty)
    assert token.main(None) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "gave an empty access token" in captured.err


class ExpiringCredentials:
    """google-auth's interface: `valid` is false once the token expired; `refresh` gets a new one."""

    def __init__(self) -> None:
        self.issued = 0
        self.token: str | None = None
        self.valid = False

    def refresh(self, request: object) -> None:
        self.issued += 1
        self.token, self.valid = f"token-{self.issued}", True


def test_a_long_watch_sends_a_fresh_token_after_each_expiry():
    from kubernetes import client

    seen: list[str | None] = []

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"kind": "NamespaceList", "apiVersion": "v1", "metadata": {},
                               "items": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        credentials = ExpiringCredentials()
        conf = client.Configuration()
        conf.host = f"http://127.0.0.1:{server.server_address[1]}"
        refresh_token_before_each_call(conf, credentials)
        api = client.CoreV1Api(client.ApiClient(conf))
        api.list_namespace()
        api.list_namespace()  # still valid: the same token
        credentials.valid = False  # the hour is over
        api.list_namespace()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Bearer token-1", "Bearer token-1", "Bearer token-2"]


class _TokenEndpoint(BaseHTTPRequestHandler):
    """Google's OAuth token endpoint, as a service account key's token_uri names it."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"access_token": "ya29.from-google-credentials",
                           "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_identity_pulumi_gcp_is_given_is_the_one_that_reaches_the_cluster(tmp_path):
    # GOOGLE_CREDENTIALS (a key's JSON) or GOOGLE_OAUTH_ACCESS_TOKEN, which pulumi-gcp reads
    # before application-default credentials, win over the machine's own (here: a metadata
    # server that would answer ya29.fake-N).
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    key = {"type": "service_account", "project_id": "my-proj", "private_key_id": "1",
           "private_key": pem, "client_email": "deployer@my-proj.iam.gserviceaccount.com",
           "token_uri": f"http://127.0.0.1:{server.server_port}/token"}
    try:
        with FakeMetadataServer({}) as metadata:
            env = token_env(metadata.host, tmp_path)
            from_key = gke_token({**env, "GOOGLE_CREDENTIALS": json.dumps(key)})
            path = tmp_path / "key.json"
            path.write_text(json.dumps(key))
            from_path = gke_token({**env, "GOOGLE_CREDENTIALS": str(path)})
            from_token = gke_token({**env, "GOOGLE_OAUTH_ACCESS_TOKEN": "ya29.given"})
            machine = gke_token(env)
    finally:
        server.shutdown()
    for done in (from_key, from_path, from_token, machine):
        assert done.returncode == 0, done.stderr
    assert json.loads(from_key.stdout)["status"]["token"] == "ya29.from-google-credentials"
    assert json.loads(from_path.stdout)["status"]["token"] == "ya29.from-google-credentials"
    assert json.loads(from_token.stdout)["status"]["token"] == "ya29.given"
    assert json.loads(machine.stdout)["status"]["token"].startswith("ya29.fake-")
