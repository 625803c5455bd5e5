"""Test certificates made with the openssl CLI: CAs, and leaf certificates for 127.0.0.1 they sign."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str


@dataclass(frozen=True)
class CA:
    directory: Path
    name: str

    @property
    def cert(self) -> str:
        return str(self.directory / f"{self.name}.pem")

    @property
    def key(self) -> str:
        return str(self.directory / f"{self.name}.key")

    @classmethod
    def create(cls, directory: Path, name: str) -> CA:
        ca = cls(directory, name)
        _openssl("req", "-x509", *_KEY, "-keyout", ca.key, "-out", ca.cert, "-days", DAYS, "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return ca

    def issue(self, name: str, *, server: bool = True, client: bool = True) -> Leaf:
        """A certificate for 127.0.0.1 / localhost, usable as a TLS server and/or client."""
        base = self.directory / name
        csr, ext = f"{base}.csr", f"{base}.ext"
        usages = ",".join(u for u, on in (("serverAuth", server), ("clientAuth", client)) if on)
        Path(ext).write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usages}\n"
                             "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n")
        _openssl("req", "-new", *_KEY, "-keyout", f"{base}.key", "-out", csr, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-CAcreateserial", "-days", DAYS,
                 "-out", f"{base}.pem", "-extfile", ext)
        return Leaf(f"{base}.pem", f"{base}.key")
