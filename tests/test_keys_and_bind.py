"""Keys: generated 0600, env wins, loose files refused; a non-loopback bind needs keys."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from clawbridge.config import Settings
from clawbridge.runtime.keys import KeyFileError, ensure_key, keys_equal
from clawbridge.server import UnsafeBind, check_bind, is_loopback


def test_generated_key_is_0600_and_stable(tmp_path: Path) -> None:
    a = ensure_key(tmp_path, "client_key", None, "cb")
    assert a.source == str(tmp_path / "client_key") and a.value.startswith("cb-") and len(a.value) > 30
    assert stat.S_IMODE(os.stat(tmp_path / "client_key").st_mode) == 0o600
    assert ensure_key(tmp_path, "client_key", None, "cb").value == a.value
    assert ensure_key(tmp_path, "client_key", "from-env", "cb").value == "from-env"


def test_loose_key_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "admin_key"
    p.write_text("k")
    p.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        ensure_key(tmp_path, "admin_key", None, "cbadmin")


def test_constant_time_compare() -> None:
    assert keys_equal("abc", "abc") and not keys_equal("abc", "abd") and not keys_equal("abc", "abcd")


def test_non_loopback_bind_needs_keys(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    with pytest.raises(UnsafeBind, match="CLAWBRIDGE_API_KEY"):
        check_bind(Settings(host="0.0.0.0", state_dir=tmp_path))
    check_bind(Settings(host="0.0.0.0", state_dir=tmp_path, api_key="cb-Zq8xW3rT9vLk2NpY7hJd4FsG",  # type: ignore[arg-type]
                        admin_key="cbadmin-Qe5Rt1Yu8Io3Pa6Sd0Fg"))  # type: ignore[arg-type]
    check_bind(Settings(host="127.0.0.1", state_dir=tmp_path))
