"""A single-member etcd child process on loopback ports (``tidemark demo`` and the tests).

Debian's ``etcd-server`` package provides the binary; ``find_etcd`` says how to get it when it is
missing. The data directory and both ports are the caller's; the log goes beside the directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

from broker.cli.node_process import free_port


class EtcdMissing(RuntimeError):
    pass


def find_etcd() -> str:
    found = shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if os.path.exists(p)), "")
    if not found:
        raise EtcdMissing("etcd is not installed: apt-get install etcd-server (make demo and make test do it)")
    return found


class EtcdProcess:
    def __init__(self, data_dir: str, *, client_port: int | None = None, cert_file: str = "", key_file: str = "",
                 client_ca_file: str = "") -> None:
        """With ``cert_file``/``key_file`` clients connect with TLS (https); with ``client_ca_file``
        they must present a certificate that CA signed."""
        self.data_dir = data_dir
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.tls = (cert_file, key_file, client_ca_file)
        self.endpoint = f"{'https' if cert_file else 'http'}://127.0.0.1:{self.client_port}"
        self.log_path = f"{data_dir.rstrip('/')}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> EtcdProcess:
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        command = [find_etcd(), "--name", "tidemark-test", "--data-dir", self.data_dir,
                   "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", f"tidemark-test={peer}", "--initial-cluster-state", "new",
                   "--logger", "zap", "--log-level", "warn"]
        cert, key, client_ca = self.tls
        if cert:
            command += ["--cert-file", cert, "--key-file", key]
        if client_ca:
            command += ["--trusted-ca-file", client_ca, "--client-cert-auth"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.uname().machine})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy within {timeout_s} s; see {self.log_path}")

    def healthy(self) -> bool:
        """Its port takes connections (with TLS the /health page would want our client certificate)."""
        if self.tls[0]:
            try:
                socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5).close()
                return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
