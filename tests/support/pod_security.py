"""Kubernetes' Pod Security Standards (kubernetes.io, "Pod Security Standards", the baseline and
restricted policies as of v1.30) applied to a pod spec: what the admission controller of a
namespace labelled pod-security.kubernetes.io/enforce=LEVEL refuses. A test oracle, written from
the published rules, for the fields a pod spec can carry."""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []),
            *pod.get("ephemeralContainers", [])]


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    found = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"{field}: true")
    contexts = [pod.get("securityContext") or {}]
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        contexts.append(sc)
        name = c.get("name")
        if sc.get("privileged"):
            found.append(f"container {name} privileged")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            found.append(f"container {name} adds capabilities {sorted(added)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"container {name} uses a hostPort")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"container {name} procMount {sc['procMount']}")
    for sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append("windowsOptions.hostProcess")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append("seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append("appArmorProfile Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            found.append(f"seLinuxOptions {se}")
    found += [f"hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    found += [f"sysctl {s['name']}" for s in (pod.get("securityContext") or {}).get("sysctls", [])
              if s["name"] not in SAFE_SYSCTLS]
    return found


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    found = baseline_violations(pod)
    pod_sc = pod.get("securityContext") or {}
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']} of type {sorted(kinds)}")
    for c in _containers(pod):
        sc, name = c.get("securityContext") or {}, c.get("name")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"container {name} allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            found.append(f"container {name} runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"container {name} runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"container {name} seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"container {name} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"container {name} adds {sorted(set(caps['add']))}")
    return found


def admitted(pod: dict[str, Any], level: str) -> list[str]:
    """What a namespace enforcing `level` refuses in `pod` (empty: admitted)."""
    if level == "privileged":
        return []
    return baseline_violations(pod) if level == "baseline" else restricted_violations(pod)
