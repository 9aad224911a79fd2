"""A gateway bound beyond loopback starts only with keys or ``access.open`` (said with a WARNING), wherever it
starts; its TLS files are checked before it serves, and it serves HTTPS with them (one process, and workers)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.config import Settings, parse_settings
from pdserve.errors import ConfigError
from pdserve.gateway.app import build_app
from pdserve.gateway.server import GatewayServer, make_gateway_server
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine

NOT_LOOPBACK = ["0.0.0.0", "::", "node", "10.1.2.3", "gateway.example"]
LOOPBACK = ["127.0.0.1", "127.0.0.2", "::1", "localhost"]
ADMIN_KEY = "sk-admin-0123456789abcdef"
DEAD_URL = "http://127.0.0.1:9"  # nothing answers: these gateways are built, or serve only their probes


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def settings_for(host: str, *, engine_url: str = DEAD_URL, access: dict[str, Any] | None = None,
                 **gateway: Any) -> Settings:
    return parse_settings({
        "prefill": {"engines": 0, "urls": [engine_url]}, "decode": {"engines": 0, "urls": [engine_url]},
        "gateway": {"host": host, "port": free_port(), "workers": 1, **gateway}, "access": access or {},
        "cache_dir": "/tmp",
    }, source="test")


def test_a_gateway_beyond_loopback_with_no_key_refuses_to_start_in_one_line_saying_how_to_open_it() -> None:
    for host in NOT_LOOPBACK:  # `node`: the Ray replica's, which builds its app the same way
        with pytest.raises(ConfigError) as refused:
            build_app(settings_for(host))
        message = str(refused.value)
        assert "\n" not in message and host in message
        assert all(words in message for words in (API_KEYS_ENV, "gateway.api_keys_file", "access.open: true",
                                                  "anyone who reaches the gateway")), message
    for host in LOOPBACK:  # the laptop demo needs no key
        build_app(settings_for(host))


def test_several_workers_are_refused_before_any_starts() -> None:
    with pytest.raises(ConfigError, match="access.open"):
        make_gateway_server(settings_for("0.0.0.0", workers=3))


def test_access_open_or_a_key_lets_it_start_and_open_says_so_at_warning(caplog: pytest.LogCaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO)
    build_app(settings_for("0.0.0.0", access={"open": True}))
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is open (access.open: true" in warnings[0], warnings
    caplog.clear()
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)  # closed: only the admin may use it
    build_app(settings_for("0.0.0.0"))
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_tls_files_go_in_pairs_and_must_load_before_the_gateway_serves(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ssl_certfile and ssl_keyfile go together"):
        settings_for("127.0.0.1", ssl_certfile=str(tmp_path / "cert.pem"))
    cert, key = self_signed(tmp_path)
    (tmp_path / "other.key").write_bytes(_key_pem(ec.generate_private_key(ec.SECP256R1())))
    for certfile, keyfile in ((tmp_path / "missing.pem", key), (cert, tmp_path / "other.key")):
        with pytest.raises(ConfigError, match="gateway.ssl_certfile .* cannot load them"):
            make_gateway_server(settings_for("127.0.0.1", ssl_certfile=str(certfile), ssl_keyfile=str(keyfile)))


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_gateway_serves_https_with_its_certificate(tmp_path: Path, workers: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of several workers builds its own uvicorn server (gateway/server.py): every one serves TLS."""
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)  # workers are spawned with this env: each /metrics wants it
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    async with serving(FakeEngine().app(), free_port()) as engine_url:
        settings = settings_for("127.0.0.1", engine_url=engine_url, workers=workers,
                                ssl_certfile=str(cert), ssl_keyfile=str(key))
        base = f"https://127.0.0.1:{settings.gateway.port}"
        async with running(make_gateway_server(settings)), aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=trust, force_close=True)) as session:  # each call: any worker
            await until_ready_over_tls(session, base)
            body = {"model": settings.model.served_name, "prompt": "hi", "max_tokens": 5, "stream": True}
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with session.post(base + "/v1/completions", json=body, headers=admin) as reply:
                assert reply.status == 200 and (await reply.read()).endswith(b"data: [DONE]\n\n")
            for _ in range(4):
                async with session.get(base + "/metrics") as reply:
                    assert reply.status == 401
                async with session.get(base + "/metrics", headers=admin) as reply:
                    assert reply.status == 200 and f"pdserve_gateway_workers_counted {workers}.0" in await reply.text()
        async with aiohttp.ClientSession() as plain, running(make_gateway_server(settings)):
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                await plain.get(f"http://127.0.0.1:{settings.gateway.port}/health/live")


@asynccontextmanager
async def running(server: GatewayServer) -> AsyncIterator[None]:
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        yield
    finally:
        server.should_exit = True
        await task


async def until_ready_over_tls(session: aiohttp.ClientSession, base: str, *, timeout_s: float = 30.0) -> None:
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline_s:
        async with session.get(base + "/health/ready") as reply:
            if reply.status == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{base} never became ready")


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and localhost), signed by its own key; the PEM files' paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test")])
    now = datetime.datetime.now(datetime.UTC)
    names = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(names, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(_key_pem(key))
    return folder / "cert.pem", folder / "key.pem"


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
