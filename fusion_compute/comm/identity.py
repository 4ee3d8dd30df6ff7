"""Participant identities: an Ed25519 key pair, carried by a self-signed X.509 certificate.

Every participant (the client and each worker) has one. The *public part* is the certificate, which
a user shares as one line of text (`fc1.` + base64url of its DER, 354 characters) and pins in the
topology file; the *secret part* (the private key) never leaves its file. TLS 1.3 (links.py) proves
possession of the key during the handshake, and the links compare the certificate a peer presents
with the pinned one byte for byte, so a participant is exactly "whoever holds the key of this line".

The certificate is only a container for the public key: no names (the subject is `fusion ` + a hash
of the key, `subject_name`), no CA, no expiry that could strand a deployment (valid 2000..9999), no
revocation list — the user revokes a key by removing its line from the topology, or, in a running
job, with `/revoke ID` or the admin endpoint (docs/resilience.md), after which the job's admission
refuses it.

    fusion keys new worker1.key        # writes the key file (mode 0600), prints the public line
    fusion keys show worker1.key       # prints the public line again

The key file is PEM: the PKCS#8 private key, then the certificate. It is read only if it is a
regular file of at most MAX_KEY_FILE bytes (a device, a FIFO or a huge file is refused in one line,
never read until memory runs out or waited on), and a key file that its group or others may read
gets a one-line warning on stderr: whoever reads it can be this participant.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

PREFIX = "fc1."  # version tag of the public line format
MAX_KEY_FILE = 64 << 10  # bytes: a key file is about 1 kB (PEM key and certificate)
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")  # unpadded, as PublicId.line writes it


class IdentityError(UsageError, ValueError):
    """A key file or public key line that is missing, malformed or of the wrong kind."""


@dataclass(frozen=True)
class PublicId:
    """A pinned participant: its self-signed certificate (DER)."""

    cert_der: bytes

    @property
    def fingerprint(self) -> str:
        """Short form for logs and errors: the first 12 hex digits of SHA-256(certificate)."""
        return hashlib.sha256(self.cert_der).hexdigest()[:12]

    def line(self) -> str:
        return PREFIX + base64.urlsafe_b64encode(self.cert_der).rstrip(b"=").decode()

    def pem(self) -> str:
        body = base64.encodebytes(self.cert_der).decode()
        return f"-----BEGIN CERTIFICATE-----\n{body}-----END CERTIFICATE-----\n"

    @staticmethod
    def parse(text: str, where: str = "key") -> PublicId:
        """A public line (`fc1.…`) -> PublicId; checks it is an Ed25519 certificate."""
        text = text.strip() if isinstance(text, str) else text
        if not isinstance(text, str) or not text.startswith(PREFIX):
            raise IdentityError(f"{where}: not a Fusion public key (expected a line starting with {PREFIX!r})")
        raw = text[len(PREFIX) :]
        # Strictly: base64's decoder skips characters outside the alphabet (`$$$$` inside a line was
        # accepted), so the line must be the alphabet only, and the exact encoding of what it decodes to.
        invalid = IdentityError(
            f"{where}: public key is not valid base64url (letters, digits, - and _ only, "
            "unpadded, as `fusion keys show` prints it)"
        )
        if _BASE64URL.fullmatch(raw) is None:
            raise invalid
        try:
            der = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        except (ValueError, TypeError):
            raise invalid from None
        _check_cert(der, where)  # a cut line: "not a certificate"
        if PublicId(der).line() != text:  # other bits in the last character: another line for the same key
            raise invalid
        return PublicId(der)


@dataclass(frozen=True)
class Identity:
    """A participant's own key pair: the public certificate and the PEM of its private key."""

    public: PublicId
    key_pem: bytes

    def pem_bundle(self) -> bytes:
        """Private key then certificate, the layout `ssl.SSLContext.load_cert_chain` reads."""
        return self.key_pem + self.public.pem().encode()

    @staticmethod
    def new() -> Identity:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.x509.oid import NameOID

        key = Ed25519PrivateKey.generate()
        # A name unique to the key: OpenSSL finds trust anchors by subject name, so certificates
        # pinned side by side must not share one.
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_name(key.public_key().public_bytes_raw()))])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(1)  # certificates differ by their keys; the serial carries nothing
            .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
            .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))
            .sign(key, None)  # Ed25519 signs without a separate digest
        )
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Identity(PublicId(cert.public_bytes(serialization.Encoding.DER)), pem)

    @staticmethod
    def from_pem(data: bytes, where: str = "key file") -> Identity:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        text = data.decode("ascii", errors="replace")
        k0, k1 = text.find("-----BEGIN PRIVATE KEY-----"), text.find("-----END PRIVATE KEY-----")
        c0 = text.find("-----BEGIN CERTIFICATE-----")
        c1 = text.find("-----END CERTIFICATE-----")
        if min(k0, k1, c0, c1) < 0:
            raise IdentityError(
                f"{where}: not a Fusion key file (expected a PEM private key and certificate; "
                "make one with `fusion keys new PATH`)"
            )
        key_pem = text[k0 : k1 + len("-----END PRIVATE KEY-----")].encode() + b"\n"
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as e:
            raise IdentityError(f"{where}: unreadable private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{where}: the private key is not Ed25519")
        body = text[c0 + len("-----BEGIN CERTIFICATE-----") : c1]
        try:
            der = base64.b64decode("".join(body.split()), validate=True)
        except ValueError:
            raise IdentityError(f"{where}: the certificate is not valid base64") from None
        cert_key = _check_cert(der, where)
        if cert_key != key.public_key().public_bytes_raw():
            raise IdentityError(f"{where}: the certificate does not belong to the private key")
        return Identity(PublicId(der), key_pem)

    @staticmethod
    def load(path: str | Path) -> Identity:
        p = Path(path)
        data, mode = read_small_file(p, MAX_KEY_FILE, "key file", IdentityError)
        ident = Identity.from_pem(data, str(p))  # a file that is no key gets its one line, not a warning too
        if mode & 0o044:  # group- or world-readable
            print(
                f"fusion: warning: key file {p} is readable by {'others' if mode & 0o004 else 'its group'} "
                f"(mode {mode & 0o777:03o}): whoever reads it can act as this participant; chmod 600 it",
                file=sys.stderr,
            )
        return ident

    def save(self, path: str | Path) -> None:
        """Write the key file, readable by its owner only; never overwrites an existing file."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise IdentityError(f"{p} exists: refusing to overwrite a key (delete it first)") from None
        except OSError as e:
            raise IdentityError(f"{p}: cannot create ({e.strerror or e})") from None
        with os.fdopen(fd, "wb") as f:
            f.write(self.pem_bundle())


def read_small_file(path: Path, limit: int, what: str, error: type[Exception]) -> tuple[bytes, int]:
    """The bytes and permission bits of a regular file of at most `limit` bytes; else `error`, one
    line. Opened without blocking (a FIFO would wait for a writer) and checked with fstat before
    any byte is read; at most limit + 1 bytes are ever read (a file that grows meanwhile too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
            raise error(f"{path}: {what} is {kind}: refused")
        if st.st_size > limit:
            raise error(f"{path}: {what} is {st.st_size} bytes, more than the {limit} a {what} can be: refused")
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{path}: {what} is more than the {limit} bytes a {what} can be: refused")
    return data, stat.S_IMODE(st.st_mode)


def subject_name(raw_public_key: bytes) -> str:
    """The certificate's common name, derived from its key: OpenSSL finds trust anchors by subject
    name, so certificates pinned side by side must never share one."""
    return "fusion " + hashlib.sha256(raw_public_key).hexdigest()[:24]


def _check_cert(der: bytes, where: str) -> bytes:
    """Parse a DER certificate; require an Ed25519 key and a valid self-signature. Returns the raw key."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        raise IdentityError(f"{where}: not a certificate") from None
    pub = cert.public_key()
    if not isinstance(pub, Ed25519PublicKey):
        raise IdentityError(f"{where}: not an Ed25519 key")
    if cert.subject.rfc4514_string() != f"CN={subject_name(pub.public_bytes_raw())}":
        raise IdentityError(f"{where}: not a Fusion participant certificate (its name does not match its key)")
    try:
        pub.verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        raise IdentityError(f"{where}: the certificate's self-signature does not verify") from None
    return pub.public_bytes_raw()
