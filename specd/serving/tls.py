"""The wire between Macs: TLS under the head's own certificate authority, pinned by the join token.

As a k3s server does, a head creates a certificate authority at its first start (``STATE/tls/``),
signs its own serving certificate with it, and writes the join token ``specd1:<sha256 of the CA
certificate>:<secret>`` (``STATE/cluster-join-token``). A worker given that token fetches the CA
from the head, refuses it unless its hash is the token's, and from then on trusts nothing else:
its join, heartbeats and the token they carry travel only inside a TLS session whose server
certificate that CA signed. At each join the worker sends a certificate signing request for the
address it advertises, and serves the head's calls (its admin API, its replicas' generate and
embed) on its cluster port with the certificate the head signs. A head or worker presenting any
other certificate fails the handshake.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TOKEN_PREFIX = "specd1"
CA_PATH = "/cluster/v1/ca"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_DAYS = 30  # a head's own certificate closer than this to expiry is issued again at start


class TokenError(ValueError):
    """A join token that is not one (a bare secret pins no CA)."""


class CertificateMismatch(Exception):
    """The head presented a CA other than the one the join token pins."""


@dataclass(frozen=True)
class JoinToken:
    ca_hash: str  # sha256 of the CA certificate's PEM, hex
    secret: str

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}:{self.ca_hash}:{self.secret}"

    @classmethod
    def parse(cls, text: str) -> "JoinToken":
        prefix, _, rest = text.strip().partition(":")
        ca_hash, _, secret = rest.partition(":")
        if prefix != TOKEN_PREFIX or len(ca_hash) != 64 or not secret \
                or any(c not in "0123456789abcdef" for c in ca_hash):
            raise TokenError("not a join token (specd1:<CA hash>:<secret>): use the one the head wrote to "
                             "STATE/cluster-join-token, which pins the head's certificate authority")
        return cls(ca_hash, secret)


def ca_hash(ca_pem: bytes) -> str:
    return hashlib.sha256(ca_pem).hexdigest()


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _subject_names(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(n for n in names if n):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, data: bytes) -> None:
    """Written whole (a temporary file renamed), readable by its owner only."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def local_names(host: str, extra: tuple[str, ...] = ()) -> list[str]:
    """What a head's certificate names: where it listens, this Mac's names (``.local`` is how
    Bonjour reaches it) and their addresses, loopback, and the operator's ``--tls-san``."""
    hostname = socket.gethostname()
    names = [host, "localhost", "127.0.0.1", "::1", hostname, f"{hostname.split('.')[0]}.local", *extra]
    try:
        names += [info[4][0] for info in socket.getaddrinfo(hostname, None)]
    except OSError:
        pass
    return [n for n in names if n not in ("0.0.0.0", "::", "")]


class ClusterCA:
    """The head's certificate authority and its own serving certificate, kept in ``directory``."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
        if not ca_cert.exists() or not ca_key.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            now = _now()
            cert = (x509.CertificateBuilder().subject_name(_name("specd cluster CA")).issuer_name(_name("specd cluster CA"))
                    .public_key(key.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(now - datetime.timedelta(minutes=5))
                    .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                    .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
                    .sign(key, hashes.SHA256()))
            write_private(ca_key, _pem(key))
            ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.pem = ca_cert.read_bytes()
        self._cert = x509.load_pem_x509_certificate(self.pem)
        self._key = serialization.load_pem_private_key(ca_key.read_bytes(), None)
        self.hash = ca_hash(self.pem)

    def join_token(self, secret: str) -> JoinToken:
        return JoinToken(self.hash, secret)

    def sign(self, csr_pem: bytes, names: list[str]) -> bytes:
        """A serving certificate for the key of ``csr_pem``, valid for ``names`` only (whatever
        the request asked for)."""
        csr = x509.load_pem_x509_csr(csr_pem)
        if not csr.is_signature_valid:
            raise ValueError("the certificate signing request's signature is not valid")
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(self._cert.subject)
                .public_key(csr.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(_subject_names(names), critical=False)
                .sign(self._key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, names: list[str]) -> ssl.SSLContext:
        """The head's listener: its own certificate for ``names``, issued again when they change
        or it nears expiry."""
        cert_path, key_path = self.directory / "head.crt", self.directory / "head.key"
        if not _still_good(cert_path, names):
            key = ec.generate_private_key(ec.SECP256R1())
            write_private(key_path, _pem(key))
            cert_path.write_bytes(self.sign(signing_request(key), names))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_path, key_path)
        return context

    def client_context(self) -> ssl.SSLContext:
        return client_context(self.pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _still_good(cert_path: Path, names: list[str]) -> bool:
    if not cert_path.exists():
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    held = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return held == _subject_names(names) and \
        cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_DAYS)


def signing_request(key: ec.EllipticCurvePrivateKey) -> bytes:
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name("specd node")).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    """Trusts certificates the cluster's CA signed, for the host they were issued to, and nothing else."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class NodeIdentity:
    """A worker's key and the serving certificate its head signed for it. The listener's context
    exists before the first join (handshakes fail until a certificate is loaded) and takes each
    new certificate in place, so a head that restarted and signed again needs no new listener."""

    def __init__(self):
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.certified = False

    def signing_request(self) -> str:
        return signing_request(self._key).decode()

    def certify(self, cert_pem: str, directory: Path) -> None:
        """Serve with the certificate the head signed (written beside the key, for the context to read)."""
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / "node.crt", directory / "node.key"
        write_private(key_path, _pem(self._key))
        cert_path.write_text(cert_pem)
        self.server.load_cert_chain(cert_path, key_path)
        self.certified = True


async def pinned_ca(head: str, token: JoinToken) -> bytes:
    """The head's CA certificate, fetched without trusting anything yet, and kept only if its hash
    is the one the join token pins (the fetch carries no secret)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(head.rstrip("/") + CA_PATH, ssl=False) as response:
            response.raise_for_status()
            pem = await response.read()
    if ca_hash(pem) != token.ca_hash:
        raise CertificateMismatch(f"the head at {head} presents a certificate authority whose hash "
                                  f"{ca_hash(pem)[:16]}… is not the join token's {token.ca_hash[:16]}…")
    return pem
