"""Files downloaded into a cache the package owns: the one HTTP path of the fetched benchmarks
(:mod:`capeval_plugins.bench.fetch`) and of released weights (``capeval fetch-weights``).

A download goes through ``huggingface_hub``'s ``http_get`` (its client, retries, progress bar and resuming by an
HTTP ``Range`` request) into ``<file>.part`` inside a :class:`capeval_plugins.files.Claim`, appended to what an
interrupted run left there; once the server says the file is complete, the bytes are checked against what is
expected (:class:`Expected`: size, SHA-256 or git blob id) and only then renamed into place; a ``.part`` that
already matches (a run stopped while checking it) is renamed without a request. Hub tokens are sent
only where the caller passes them (the Hub); other servers get no credentials.

Redirects (:func:`guarded_redirects`) are followed, up to :data:`MAX_REDIRECTS`, to another host as well (a
release served from a CDN, Google Drive's download host): the digest, not the host, decides what is accepted.
A redirect from ``https`` to ``http`` (a downgrade anyone on the path could forge) and one to any scheme but
``http`` / ``https`` (``file:``, ``ftp:``) are refused before the request is sent.

Failures are :class:`DownloadError` with a ``kind`` the caller turns into its own one-line message: ``"failed"``
(the server could not be reached or answered an error: the ``.part`` is kept, a later run resumes), ``"short"``
(the transfer ended before the file's size, as the server or :class:`Expected` gives it, or with no size given
by either: kept, a later run resumes), ``"changed"`` (a whole transfer, the size reached or nothing past it on the
server (416), with other bytes than expected, or a server whose file has another size than expected: the
``.part`` is deleted) and ``"redirect"`` (a refused redirect). When no size is given and the bytes do not match,
one more ``Range`` request for what follows them tells a cut transfer from a whole one in the same run."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from capeval_plugins import files
from capeval_plugins.core.messages import DataError

LOCK = ".lock"
MAX_REDIRECTS = 10


@dataclass(frozen=True)
class Expected:
    """What a downloaded file must be: its size (None: any), its SHA-256 and / or git blob id (None: unchecked)."""

    size: int | None = None
    sha256: str | None = None
    blob: str | None = None

    @property
    def checkable(self) -> bool:
        """Whether anything is checked: with nothing expected, any bytes match, a part-way download too."""
        return self.size is not None or bool(self.sha256 or self.blob)

    def matches(self, data: Any) -> bool:
        if data is None or (self.size is not None and len(data) != self.size):
            return False
        if self.sha256:
            return hashlib.sha256(data).hexdigest() == self.sha256.lower()
        if self.blob:
            return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == self.blob
        return True


class DownloadError(DataError):
    """A download that did not give the expected file; ``kind`` says how (see the module docstring), ``detail``
    what happened, ``got`` the size and SHA-256 of what arrived (``"changed"``, ``"short"``)."""

    def __init__(self, kind: str, detail: str, got: tuple[int, str] | None = None) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.got = kind, detail, got


@contextlib.contextmanager
def locked(root: Path, kind: str, what: str, error: type[DataError] = DataError) -> Iterator[files.Claim]:
    """The cache folder ``root`` (made if missing, private), claimed for ``kind`` and locked (another process
    fetching meanwhile: wait for it). A folder others can write is refused (``error``), naming ``what`` it keeps."""
    folder, _ = files.Folder.open(root, create=True, mine=True, mode=0o700)
    with folder:
        if os.fstat(folder.fd).st_mode & 0o022:
            raise error(f"{root} can be written by other users; capeval keeps {what} only in a folder no one else "
                            f"can write: chmod go-w {root}, or set CAPEVAL_CACHE to another folder")
        files.Claim(root, kind).open(create=False).folder.close()  # a foreign marker: refused before the lock is made
        fd, _ = folder.lock(LOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            claim = files.Claim(root, kind).open()
            try:
                yield claim
            finally:
                claim.folder.close()
        finally:
            os.close(fd)


@contextlib.contextmanager
def guarded_redirects(url: str) -> Iterator[list[str]]:
    """Every request of the shared ``huggingface_hub`` client checked while the block runs (the first and each
    redirect): refused when it goes from https to http, to a scheme other than http(s), or past
    :data:`MAX_REDIRECTS`. Yields the URLs requested, in order."""
    from huggingface_hub.utils import get_session

    start = urlsplit(url).scheme.lower()
    seen: list[str] = []

    def check(request: Any) -> None:
        target = str(request.url)
        scheme = urlsplit(target).scheme.lower()
        if scheme not in ("http", "https"):
            raise DownloadError("redirect", f"a redirect to {target} (only http and https are followed)")
        if start == "https" and scheme == "http":
            raise DownloadError("redirect", f"a redirect from https to {target} (a downgrade to plain http)")
        seen.append(target)
        if len(seen) > MAX_REDIRECTS + 1:
            raise DownloadError("redirect", f"more than {MAX_REDIRECTS} redirects")

    session = get_session()
    hooks = {k: list(v) for k, v in session.event_hooks.items()}
    session.event_hooks = {**hooks, "request": [*hooks.get("request", []), check]}
    try:
        yield seen
    finally:
        session.event_hooks = hooks


@contextlib.contextmanager
def progress_bars(show: bool) -> Iterator[None]:
    """``huggingface_hub``'s progress bars on or off for the block (as they were before, after it)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    show = show and constants.HF_HUB_DISABLE_PROGRESS_BARS is not True  # the variable (--quiet) has priority
    was_disabled = are_progress_bars_disabled()
    if show == was_disabled:
        (enable_progress_bars if show else disable_progress_bars)()
    try:
        yield
    finally:
        if show == was_disabled:
            (disable_progress_bars if was_disabled else enable_progress_bars)()


def download(claim: files.Claim, folder: str, leaf: str, url: str, expected: Expected, *,
             headers: dict[str, str] | None = None, display: str | None = None, progress: bool = True) -> str:
    """``url`` into ``folder/leaf`` of ``claim`` (``folder``: a relative path, "" for the claim's root): kept when
    the file is there already and matches ``expected``; else appended to ``leaf.part`` from where an interrupted
    download stopped (a ``Range`` request), checked, and renamed into place. Returns the file's name in the claim."""
    parts = [p for p in folder.split("/") if p]
    final = "/".join([*parts, leaf])
    part = final + ".part"
    if claim.owns(final) and expected.matches(claim.map(final)):
        return final
    claim.own([*("/".join(parts[: k + 1]) + "/" for k in range(len(parts))), part])
    request = _Request(url, dict(headers or {}), display or leaf, progress)
    with _folder(claim, parts) as where:
        _fill(where, leaf + ".part", expected, request)
        claim.own([final])
        where.rename(leaf + ".part", leaf)
    claim.remove([part])
    return final


@dataclass(frozen=True)
class _Request:
    """What to ask for (``url`` with ``headers``) and how to show it (progress bar, file name)."""

    url: str
    headers: dict[str, str]
    display: str
    progress: bool


@dataclass(frozen=True)
class _Answer:
    """What the server said of the file in a transfer that ended: its whole size (None: not said), and whether it
    had no bytes past those already downloaded (416)."""

    total: int | None
    nothing_past: bool = False


def _fill(where: files.Folder, name: str, expected: Expected, request: _Request) -> None:
    """``name`` completed from the server until it matches ``expected``; a DownloadError otherwise."""
    done = where.size(name)
    if done and expected.checkable and expected.matches(where.map(name)):
        return  # complete already: a run stopped while it was being checked
    if expected.size is not None and done > expected.size:
        where.truncate(name, 0)
    answer = _transfer(where, name, request)
    if answer.total is None and not answer.nothing_past and expected.size is None \
            and not expected.matches(where.map(name)):
        # no size said: a request for the bytes past the end tells a cut transfer (more, or a size) from a whole
        # one (416), in this run rather than the next
        answer = _transfer(where, name, request)
    _judge(where, name, expected, answer)


def _transfer(where: files.Folder, name: str, request: _Request) -> _Answer:
    """One ``http_get`` appending to ``name`` from its end; what the server said of the file. A DownloadError
    "failed" when the transfer did not end (unreachable, an error status, a connection lost on the way: what
    arrived is kept) or "redirect"."""
    from huggingface_hub.file_download import http_get

    before = where.size(name)
    with guarded_redirects(request.url), _responses() as responses:
        try:
            with progress_bars(request.progress), where.open_append(name) as handle:
                http_get(request.url, handle, resume_size=before, headers=request.headers,
                         displayed_filename=request.display)
        except (files.FileError, KeyboardInterrupt, DownloadError):
            raise
        except Exception as err:  # noqa: BLE001  (no network, DNS, an HTTP error status, a proxy, ...)
            if isinstance(err, OSError) and files.is_environment_error(err):  # a full disk: the machine's
                raise
            total = _declared_size(responses[-1]) if responses else None
            if _status(err) == 416:  # no bytes past ``before``
                return _Answer(before if total is None else total, nothing_past=True)
            if type(err) is OSError and err.errno is None:  # http_get's check: the body ended before the size given
                return _Answer(total)
            raise DownloadError("failed", _reason(err)) from None
        return _Answer(_declared_size(responses[-1]) if responses else None)


def _judge(where: files.Folder, name: str, expected: Expected, answer: _Answer) -> None:
    """Nothing when ``name`` matches ``expected``; else a DownloadError: "short" (kept) when the server has more of
    the file or did not say its size, "changed" (deleted) when the transfer was whole or the server's file has
    another size than expected."""
    data = where.map(name)
    if expected.matches(data):
        return
    got = (len(data or b""), hashlib.sha256(data or b"").hexdigest())
    total = answer.total if answer.total is not None else expected.size
    resized = None not in (answer.total, expected.size) and answer.total != expected.size
    if not (answer.nothing_past or resized) and (total is None or got[0] < total):
        said = f"of {total} bytes" if total is not None else "bytes without saying the file's size"
        raise DownloadError("short", f"the server ended the file at {got[0]} {said}", got)
    where.unlink(name)
    raise DownloadError("changed", _difference(got, answer, resized), got)


def _difference(got: tuple[int, str], answer: _Answer, resized: bool) -> str:
    """How a whole transfer differs from the file expected, in words."""
    if answer.nothing_past and answer.total < got[0]:
        return (f"the server's file has {answer.total} bytes, fewer than the {got[0]} downloaded before "
                "(416 Range Not Satisfiable)")
    if resized:
        return f"the server's file has {answer.total} bytes"
    more = "; the server has no more (416 Range Not Satisfiable)" if answer.nothing_past else ""
    return f"got {got[0]} bytes with SHA-256 {got[1]}{more}"


@contextlib.contextmanager
def _folder(claim: files.Claim, parts: list[str]) -> Iterator[files.Folder]:
    with contextlib.ExitStack() as stack:
        where = claim.folder
        for name in parts:
            where = stack.enter_context(where.sub(name, create=True))
        yield where


@contextlib.contextmanager
def _responses() -> Iterator[list[Any]]:
    """The responses the shared ``huggingface_hub`` client receives while the block runs (headers read, not the
    body), in order: the last one is the file's."""
    from huggingface_hub.utils import get_session

    seen: list[Any] = []
    session = get_session()
    hooks = {k: list(v) for k, v in session.event_hooks.items()}
    session.event_hooks = {**hooks, "response": [*hooks.get("response", []), seen.append]}
    try:
        yield seen
    finally:
        session.event_hooks = hooks


def _declared_size(response: Any) -> int | None:
    """The whole file's size as ``response`` gives it: Content-Range's total (a 206, a 416), else a 200's
    Content-Length when the body is not encoded; None when it gives neither."""
    total = response.headers.get("Content-Range", "").rpartition("/")[2].strip()
    if total.isdigit():
        return int(total)
    length = response.headers.get("Content-Length", "").strip()
    plain = response.headers.get("Content-Encoding", "identity").lower() == "identity"
    return int(length) if response.status_code == 200 and plain and length.isdigit() else None


def _status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _reason(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
