"""Access keys: where they come from, what a malformed one says (never the key), what each grants."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV, Access, AccessKeys, load_access_keys
from pdserve.errors import ConfigError
from pdserve.gateway_config import GatewaySpec

KEY_A, KEY_B, ADMIN = "a" * 16 + "-client", "b" * 16 + "-client", "c" * 16 + "-admin"


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def test_keys_come_from_the_env_and_files_and_stay_out_of_repr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text(f"# comment\n{KEY_B}\n")
    (tmp_path / "admin").write_text(f"{ADMIN}\n")
    monkeypatch.setenv(API_KEYS_ENV, f"{KEY_A}, ")
    keys = load_access_keys(GatewaySpec(api_keys_file=str(tmp_path / "keys"), admin_key_file=str(tmp_path / "admin")))
    assert keys.api_keys == (KEY_A.encode(), KEY_B.encode()) and keys.admin_key == ADMIN.encode()
    assert KEY_A not in repr(keys) and ADMIN not in repr(keys)
    assert keys.headers() == {"Authorization": f"Bearer {ADMIN}"}


@pytest.mark.parametrize("bad", ["short", "has space in the middle of it", "ünïcödé-is-not-a-key-here"])
def test_a_malformed_key_is_a_config_error_that_does_not_quote_it(tmp_path: Path, bad: str) -> None:
    (tmp_path / "keys").write_text(f"{KEY_A}\n{bad}\n")
    with pytest.raises(ConfigError, match="key 2 must be") as caught:
        load_access_keys(GatewaySpec(api_keys_file=str(tmp_path / "keys")))
    assert bad not in str(caught.value) and KEY_A not in str(caught.value)


def test_a_missing_key_file_and_two_admin_keys_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="cannot read key file"):
        load_access_keys(GatewaySpec(api_keys_file=str(tmp_path / "nope")))
    (tmp_path / "admin").write_text(f"{ADMIN}\n")
    monkeypatch.setenv(ADMIN_KEY_ENV, KEY_A)
    with pytest.raises(ConfigError, match="one admin key"):
        load_access_keys(GatewaySpec(admin_key_file=str(tmp_path / "admin")))


@pytest.mark.parametrize(("keys", "header", "granted"), [
    (AccessKeys(), None, Access.ADMIN),  # no keys: open, as on a laptop
    (AccessKeys(api_keys=(KEY_A.encode(),)), None, Access.NONE),
    (AccessKeys(api_keys=(KEY_A.encode(),)), f"Bearer {KEY_A}".encode(), Access.CLIENT),
    (AccessKeys(api_keys=(KEY_A.encode(),)), f"Bearer {KEY_A}x".encode(), Access.NONE),
    (AccessKeys(admin_key=ADMIN.encode()), None, Access.NONE),  # an admin key alone opens nothing to others
    (AccessKeys(admin_key=ADMIN.encode()), f"Bearer {KEY_A}".encode(), Access.NONE),
    (AccessKeys(admin_key=ADMIN.encode()), f"Bearer {ADMIN}".encode(), Access.ADMIN),
    (AccessKeys(api_keys=(KEY_A.encode(),), admin_key=ADMIN.encode()), f"BEARER {ADMIN}".encode(), Access.ADMIN),
    (AccessKeys(api_keys=(KEY_A.encode(),), admin_key=ADMIN.encode()), f"Bearer {KEY_A}".encode(), Access.CLIENT),
    (AccessKeys(api_keys=(KEY_A.encode(),)), b"Bearer", Access.NONE),
    (AccessKeys(api_keys=(KEY_A.encode(),)), b"\xff\xfe Bearer", Access.NONE),
])
def test_what_a_header_grants(keys: AccessKeys, header: bytes | None, granted: Access) -> None:
    assert keys.grant(header) is granted
