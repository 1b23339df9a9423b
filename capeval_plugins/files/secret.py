"""The user's secret (kept outside every run folder, readable by the user only) and what it signs: a marker or a
scratch name verifies only when the package wrote it for this user."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets as _secrets
import stat
from pathlib import Path
from typing import Any

from capeval_plugins.files.paths import user_base
from capeval_plugins.files.base import _CLOEXEC, _NOFOLLOW, StorageError, UnsafePath, _reported


def config_dir() -> Path:
    """``$CAPEVAL_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/capeval_plugins`` (``~/.config/capeval_plugins``; as
    root with another user's HOME, root's own, see :func:`user_base`)."""
    if os.environ.get("CAPEVAL_CONFIG_DIR"):
        return Path(os.environ["CAPEVAL_CONFIG_DIR"])
    return user_base("config") / "capeval_plugins"


SECRET_FILE = "secret.key"
_secret_cache: dict[str, bytes] = {}


def secret_path() -> Path:
    """Where the user's secret is kept: ``<config_dir>/secret.key``."""
    return config_dir() / SECRET_FILE


def secret() -> bytes:
    """The user's 32-byte secret, made on first use: ``<config_dir>/secret.key``, created 0600 in a folder
    made 0700. A key file that is a link, not the user's, or readable by others is refused."""
    folder = config_dir()
    cached = _secret_cache.get(str(folder))
    if cached is not None:
        return cached
    from capeval_plugins.files.folder import Folder  # imported here: a folder's signed scratch names use the secret
    with _reported(folder, "create the key folder"):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = secret_path()
    if not os.path.lexists(path):  # made whole under a private name, then linked in: a racing process
        try:                         # sees no key or the whole key, and the first one made wins
            with Folder.open(folder, mine=True)[0] as where:
                where.write(SECRET_FILE, _secrets.token_bytes(32), replace=False, mode=0o600)
        except FileExistsError:
            pass
        except (OSError, UnsafePath) as err:
            raise StorageError(f"cannot create the key file {path}: {getattr(err, 'strerror', None) or err}; set "
                               "CAPEVAL_CONFIG_DIR to a private folder you can write") from None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as err:
        raise UnsafePath(f"cannot read the key file {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafePath(f"the key file {path} must be a regular file of yours that only you can read "
                             "(chmod 600); remove it to make a new one (run folders made with it are then refused)")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise UnsafePath(f"the key file {path} is damaged (remove it to make a new one)")
    _secret_cache[str(folder)] = key
    return key


def mac(key: bytes, *parts: bytes | str) -> str:
    """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two part lists collide), hex."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def signed_json(content: Any, kind: str, key: bytes | None = None) -> bytes:
    """``content`` as JSON with an HMAC of it (``kind`` separates uses: a marker never verifies as a run)."""
    body = json.dumps(content, sort_keys=True, default=str)
    tag = mac(key if key is not None else secret(), kind, body)
    return json.dumps({"content": json.loads(body), "hmac": tag}, indent=1, sort_keys=True).encode()


def read_signed_json(data: bytes | None, kind: str, key: bytes | None = None) -> Any:
    """The content of :func:`signed_json` output, or None when it does not verify (damaged, forged, written
    with another key, or not such a file)."""
    if data is None:
        return None
    try:
        outer = json.loads(data)
        body = json.dumps(outer["content"], sort_keys=True, default=str)
        tag = mac(key if key is not None else secret(), kind, body)
        if not isinstance(outer.get("hmac"), str) or not hmac.compare_digest(tag, outer["hmac"]):
            return None
        return outer["content"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None

