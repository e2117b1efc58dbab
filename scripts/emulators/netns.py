"""One network namespace per emulated TPU job, with this machine's loopback servers in it.

Every host of a job joins its job's namespace, so each job has its own loopback and its own JAX
coordinator port (worker 0's 127.0.0.1:8482, as the worker metadata says), and jobs boot side by
side under pytest -n. The servers the hosts talk to (the GCS emulator, the IAM proxy, each host's
metadata server) listen on this machine's loopback: `JobNetwork.forward(port)` makes
127.0.0.1:port inside the namespace reach 127.0.0.1:port outside it. The listening socket is made
inside the namespace by a short-lived thread that joined it (setns(2) moves only the calling
thread), and every connection it accepts is relayed from outside.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class JobNetwork:
    """A network namespace holding only `lo` (up), alive while its holder process runs."""

    def __init__(self) -> None:
        self._holder = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != "up":
            self._holder.kill()
            raise RuntimeError("cannot make a network namespace (unshare --net, ip link): "
                               + (self._holder.stderr.read() if self._holder.stderr else ""))
        self.path = f"/proc/{self._holder.pid}/ns/net"
        self._listeners: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self.closed = False

    def forward(self, port: int, inside: int | None = None) -> None:
        """127.0.0.1:`inside` (default: the same port) inside the namespace reaches
        127.0.0.1:port outside it: `inside=443` puts an HTTPS stand-in where its real
        service's URL has no port."""
        inside = port if inside is None else inside
        with self._lock:
            if inside in self._listeners:
                return
            listener = self._listen_inside(inside)
            self._listeners[inside] = listener
        threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def _listen_inside(self, port: int) -> socket.socket:
        made: dict[str, object] = {}

        def inside() -> None:  # this thread joins the namespace and ends: the socket stays there
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns {self.path}: {os.strerror(errno)}")
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
                made["socket"] = sock
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
                made["error"] = exc
            finally:
                os.close(fd)

        thread = threading.Thread(target=inside)
        thread.start()
        thread.join()
        if "error" in made:
            raise made["error"]  # type: ignore[misc]
        return made["socket"]  # type: ignore[return-value]

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                inner, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                outer = socket.create_connection(("127.0.0.1", port), timeout=30)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            threading.Thread(target=_relay, args=(inner, outer), daemon=True).start()

    def close(self) -> None:
        self.closed = True
        with self._lock:
            for listener in self._listeners.values():
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
                listener.close()
            self._listeners.clear()
        with contextlib.suppress(ProcessLookupError):
            self._holder.kill()
        self._holder.wait()


def _relay(inner: socket.socket, outer: socket.socket) -> None:
    back = threading.Thread(target=_pump, args=(outer, inner), daemon=True)
    back.start()
    _pump(inner, outer)
    back.join()
    inner.close()
    outer.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 20):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            src.shutdown(socket.SHUT_RD)
