"""Certificates for the local broker's TLS listener, made the way its users make theirs: a
private CA and a broker key with openssl (a PEM file), or a self-signed keystore with Java's
keytool (PKCS12). Every certificate names 127.0.0.1, the address the broker advertises."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SUBJECT_ALT_NAME = "subjectAltName=IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True, slots=True)
class BrokerCertificate:
    """What a user hands the stack: the keystore, its password file (None for an unencrypted
    PEM key) and the CA file clients trust."""

    keystore: Path
    password_file: Path | None
    ca_file: Path


def _run(*argv: str, cwd: Path) -> None:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=120)


def openssl_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A private CA: (its certificate, its key), both PEM."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _run(
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN=opledger test {name}", "-keyout", str(key), "-out", str(cert),
        cwd=directory,
    )  # fmt: skip
    return cert, key


def openssl_pem_keystore(
    directory: Path, *, encrypt_with: str | None = None, pkcs8: bool = True
) -> BrokerCertificate:
    """A broker key and a certificate signed by a new private CA, as one PEM file (the key,
    then the chain), 0600. ``encrypt_with`` encrypts the key (PKCS#8, AES-256) under that
    password; ``pkcs8=False`` leaves it in the traditional RSA form Kafka cannot read."""
    ca_cert, ca_key = openssl_ca(directory)
    key, csr, cert = directory / "broker.key", directory / "broker.csr", directory / "broker.crt"
    _run(
        "openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-addext", _SUBJECT_ALT_NAME, "-keyout", str(key), "-out", str(csr),
        cwd=directory,
    )  # fmt: skip
    extensions = directory / "san.ext"
    extensions.write_text(_SUBJECT_ALT_NAME + "\n")
    _run(
        "openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert),
        cwd=directory,
    )  # fmt: skip
    password_file = None
    if encrypt_with is not None:
        password_file = directory / "broker.password"
        password_file.write_text(encrypt_with + "\n")
        os.chmod(password_file, 0o600)
        encrypted = directory / "broker.enc.key"
        _run(
            "openssl", "pkcs8", "-topk8", "-v2", "aes256", "-in", str(key),
            "-passout", f"file:{password_file}", "-out", str(encrypted),
            cwd=directory,
        )  # fmt: skip
        key = encrypted
    elif not pkcs8:
        traditional = directory / "broker.rsa.key"
        _run(
            "openssl", "rsa", "-traditional", "-in", str(key), "-out", str(traditional),
            cwd=directory,
        )  # fmt: skip
        key = traditional
    keystore = directory / "broker.pem"
    keystore.write_bytes(key.read_bytes() + cert.read_bytes() + ca_cert.read_bytes())
    os.chmod(keystore, 0o600)
    return BrokerCertificate(keystore, password_file, ca_cert)


def keytool_pkcs12_keystore(directory: Path, password: str) -> BrokerCertificate:
    """A self-signed broker key pair in a PKCS12 keystore made by keytool, and its
    certificate exported as PEM for clients to trust."""
    directory.mkdir(parents=True, exist_ok=True)
    keystore, ca = directory / "broker.p12", directory / "broker-cert.pem"
    _run(
        "keytool", "-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048",
        "-validity", "2", "-dname", "CN=127.0.0.1", "-ext", "SAN=ip:127.0.0.1,dns:localhost",
        "-storetype", "PKCS12", "-keystore", str(keystore),
        "-storepass", password, "-keypass", password,
        cwd=directory,
    )  # fmt: skip
    _run(
        "keytool", "-exportcert", "-rfc", "-alias", "broker", "-keystore", str(keystore),
        "-storepass", password, "-file", str(ca),
        cwd=directory,
    )  # fmt: skip
    os.chmod(keystore, 0o600)
    password_file = directory / "broker.password"
    password_file.write_text(password + "\n")
    os.chmod(password_file, 0o600)
    return BrokerCertificate(keystore, password_file, ca)
