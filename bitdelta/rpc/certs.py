"""A local CA and one certificate per service, for the demo, the tests and Kubernetes Secrets.

    python -m bitdelta.rpc.certs --out certs/                     # ca.pem + router, worker, delta-store,
                                                                  # gateway, client (.pem/.key)
    python -m bitdelta.rpc.certs --out certs/ --names router,my-tool --dns router.prod.svc

Every certificate is signed by `ca.pem`, is valid for both server and client use (a service is
both: the router serves clients and calls workers) and names 127.0.0.1, ::1, localhost, the
service's name and its Kubernetes Service names (`<name>`, `<name>.<namespace>`,
`<name>.<namespace>.svc`, `<name>.<namespace>.svc.cluster.local`, and `*.<name>...` for the
pods of a headless Service such as `worker-0.worker`). Keys are EC P-256. The CA's key is
written too (`ca.key`, to issue more); keep it out of the cluster.

    python -m bitdelta.rpc.certs --out certs/ --names router,gpu-worker,delta-store,gateway,client \
        --tokens --k8s-secrets certs/secrets.yaml       # + tokens.json/tokens.txt and the Secrets deploy/k8s mounts

`--tokens` writes `tokens.json` (an admin token and a user token allowed every model, stored by
sha256) and `tokens.txt` (the tokens themselves, mode 0600: hand them out, then delete it), unless
`tokens.json` exists. `--k8s-secrets FILE` writes one Secret `bitdelta-tls-<name>` per certificate
(`ca.pem`, `tls.pem`, `tls.key`) and `bitdelta-tokens` (`tokens.json`).

Development tooling: needs the `cryptography` package; nothing that serves imports it.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SERVICES = ("router", "worker", "delta-store", "gateway", "client")
DAYS = 365


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(out: Path, name: str = "bitdelta-serve local CA", days: int = DAYS) -> Issued:
    """A self-signed CA: `out/ca.pem`, `out/ca.key`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    out = Path(out)
    _write(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca.key", _pem_key(key), private=True)
    return Issued(out / "ca.pem", out / "ca.key")


def k8s_names(name: str, namespace: str = "bitdelta") -> list[str]:
    """The DNS names a Kubernetes Service `name` (and its headless pods) is called by."""
    out = [name]
    for suffix in (f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.cluster.local"):
        out += [name + suffix, f"*.{name}{suffix}"]
    return out + [f"*.{name}"]


def issue(
    out: Path,
    name: str,
    *,
    ca_dir: Path | None = None,
    dns: Sequence[str] = (),
    namespace: str = "bitdelta",
    days: int = DAYS,
) -> Issued:
    """`out/<name>.pem` and `out/<name>.key`, signed by `ca_dir` (default `out`)'s ca.pem/ca.key;
    CN = `name`; SANs: loopback, localhost, the Kubernetes names of `name` and `dns`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    ca_dir = Path(ca_dir or out)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    key = _key()
    names = list(dict.fromkeys(["localhost", *k8s_names(name, namespace), *dns]))
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / f"{name}.key", _pem_key(key), private=True)
    return Issued(out / f"{name}.pem", out / f"{name}.key")


def make_all(
    out: Path,
    names: Sequence[str] = SERVICES,
    *,
    dns: Sequence[str] = (),
    namespace: str = "bitdelta",
    days: int = DAYS,
) -> dict[str, Issued]:
    """A CA (kept if `out/ca.pem` and `out/ca.key` exist) and a certificate for each of `names`."""
    out = Path(out)
    if not ((out / "ca.pem").is_file() and (out / "ca.key").is_file()):
        make_ca(out, days=days)
    return {n: issue(out, n, dns=dns, namespace=namespace, days=days) for n in names}


def make_tokens(out: Path) -> Path:
    """`out/tokens.json` with a new admin and a new user token (kept if it exists); the tokens in
    `out/tokens.txt` (0600)."""
    out = Path(out)
    path = out / "tokens.json"
    if path.is_file():
        return path
    tokens = {"admin": secrets.token_urlsafe(32), "user": secrets.token_urlsafe(32)}
    table = {
        f"sha256:{hashlib.sha256(t.encode()).hexdigest()}": {"name": n, "variants": "*", "admin": n == "admin"}
        for n, t in tokens.items()
    }
    _write(path, (json.dumps(table, indent=2) + "\n").encode(), private=True)
    _write(out / "tokens.txt", "".join(f"{n} {t}\n" for n, t in tokens.items()).encode(), private=True)
    return path


def k8s_secrets(out: Path, names: Sequence[str], namespace: str = "bitdelta") -> str:
    """YAML of the Secrets deploy/k8s mounts: bitdelta-tls-<name> for each of `names`, and
    bitdelta-tokens when `out/tokens.json` exists."""
    out = Path(out)

    def secret(name: str, files: dict[str, Path]) -> str:
        data = "".join(f"  {k}: {base64.b64encode(p.read_bytes()).decode()}\n" for k, p in files.items())
        return (
            f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\n"
            f"type: Opaque\ndata:\n{data}"
        )

    docs = [
        secret(
            f"bitdelta-tls-{n}", {"ca.pem": out / "ca.pem", "tls.pem": out / f"{n}.pem", "tls.key": out / f"{n}.key"}
        )
        for n in names
    ]
    if (out / "tokens.json").is_file():
        docs.append(secret("bitdelta-tokens", {"tokens.json": out / "tokens.json"}))
    return "---\n".join(docs)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bitdelta.rpc.certs", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for ca.pem/ca.key and <name>.pem/.key")
    p.add_argument("--names", default=",".join(SERVICES), help="certificates to issue, comma-separated")
    p.add_argument("--dns", default="", help="extra DNS names for every certificate, comma-separated")
    p.add_argument("--namespace", default="bitdelta", help="Kubernetes namespace for the service names")
    p.add_argument("--days", type=int, default=DAYS)
    p.add_argument("--tokens", action="store_true", help="also write tokens.json / tokens.txt (kept if present)")
    p.add_argument("--k8s-secrets", type=Path, help="also write the Kubernetes Secrets (YAML) to this file")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.names.split(",") if n.strip()]
    dns = [n.strip() for n in a.dns.split(",") if n.strip()]
    issued = make_all(a.out, names, dns=dns, namespace=a.namespace, days=a.days)
    print(f"CA {a.out / 'ca.pem'}; " + ", ".join(f"{n}: {i.cert.name}/{i.key.name}" for n, i in issued.items()))
    if a.tokens:
        print(f"tokens: {make_tokens(a.out)} (the tokens themselves: {a.out / 'tokens.txt'}, if new)")
    if a.k8s_secrets:
        _write(a.k8s_secrets, k8s_secrets(a.out, names, a.namespace).encode(), private=True)
        print(f"Kubernetes Secrets: {a.k8s_secrets} (kubectl apply -f {a.k8s_secrets})")


if __name__ == "__main__":
    main()
