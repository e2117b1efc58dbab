"""Kubernetes' name syntaxes (k8s.io/apimachinery/pkg/util/validation) and the variable that points
this toolkit's Kubernetes clients at another API server: defined once, for the stack's checks, the
CLI's clients and the stand-ins of the API server and of the JobSet webhook."""

from __future__ import annotations

import re

# An API server to use instead of the cluster's endpoint: a `kubectl proxy`, or the rehearsal's
# loopback stand-in. Honoured by preview's cluster check and by status, watch and babysit.
KUBERNETES_API_ENV = "MULTISLICE_KUBERNETES_API"

# Namespaces every cluster has: a stack may run in one but never declares it.
CLUSTER_NAMESPACES = ("default",)

MAX_LABEL_CHARS = 63
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?\Z")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")  # also a non-empty value


def is_label_value(value: str) -> bool:
    """A label value: empty, or at most 63 characters of the label-name syntax."""
    return value == "" or (len(value) <= MAX_LABEL_CHARS and bool(LABEL_NAME.match(value)))


def is_label_key_name(name: str) -> bool:
    """The name part of a label key (no prefix): 1 to 63 characters of the label-name syntax."""
    return len(name) <= MAX_LABEL_CHARS and bool(LABEL_NAME.match(name))


def is_namespace_name(name: str) -> bool:
    """A namespace's (or a WorkloadPriorityClass's) name: a DNS-1123 label of at most 63."""
    return len(name) <= MAX_LABEL_CHARS and bool(DNS1123_LABEL.match(name))
