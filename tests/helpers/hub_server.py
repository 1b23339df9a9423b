"""A miniature Hugging Face Hub on 127.0.0.1 for the fetching tests: dataset repositories whose refs point at
commits of files, served through the endpoints the real ``huggingface_hub`` client calls (point ``HF_ENDPOINT``
at :attr:`Hub.url`):

* ``GET /api/datasets/{repo}/revision/{rev}``: the repository's information at a ref or commit (``sha``);
* ``GET /api/datasets/{repo}/tree/{rev}[/{folder}]``: the files under a folder (``?recursive=true``), each with
  its git blob id, size and, for files marked LFS, ``lfs.oid`` (SHA-256);
* ``GET`` / ``HEAD /datasets/{repo}/resolve/{rev}/{path}``: the file, with ``Range`` requests answered 206.

Faults for the tests: :meth:`Hub.stall` makes a file's download stop after a number of bytes and hang until
released (a download interrupted part-way, as when its process is killed); :meth:`Hub.hang` makes every download
of a file send its headers and then nothing (a Hub too slow to answer); :meth:`Hub.replace_content` serves
other bytes for a file under the same commit (a file changed under the same name). :attr:`Hub.log` records
every request (method, path, Range header)."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


class Hub:
    def __init__(self) -> None:
        self.refs: dict[str, dict[str, str]] = {}        # repo -> ref -> commit
        self.commits: dict[str, dict[str, bytes]] = {}   # commit -> path -> content
        self.listed: dict[str, dict[str, bytes]] = {}    # commit -> path -> content its listing describes
        self.lfs: set[str] = set()                       # paths stored as LFS files
        self.stalls: dict[str, int] = {}
        self.hangs: set[str] = set()
        self.released = threading.Event()
        self.log: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    # -- content --

    def commit(self, repo: str, content: dict[str, bytes], ref: str = "main", lfs: bool = True) -> str:
        """A new commit of ``repo`` holding ``content`` (path -> bytes), which ``ref`` then points at."""
        sha = hashlib.sha1(repr((repo, ref, sorted(content.items()), len(self.commits))).encode()).hexdigest()
        self.commits[sha] = dict(content)
        self.listed[sha] = dict(content)
        if lfs:
            self.lfs.update(p for p in content if not p.endswith((".md", ".gitattributes")))
        self.refs.setdefault(repo, {})[ref] = sha
        return sha

    def replace_content(self, commit: str, path: str, content: bytes) -> None:
        """Serve ``content`` for ``path`` under ``commit`` while its listing still describes the old file."""
        self.commits[commit][path] = content

    def stall(self, path: str, after: int) -> None:
        """Downloads of ``path`` send ``after`` bytes, then hang until :meth:`release`."""
        self.stalls[path] = after
        self.released.clear()

    def hang(self, path: str) -> None:
        """Every download of ``path`` (resumed ones too) sends its headers, then nothing until :meth:`release`."""
        self.hangs.add(path)
        self.released.clear()

    def release(self) -> None:
        self.stalls.clear()
        self.hangs.clear()
        self.released.set()

    # -- answers --

    def resolve(self, repo: str, rev: str) -> str | None:
        if rev in self.commits and rev in self.refs.get(repo, {}).values():
            return rev
        return self.refs.get(repo, {}).get(rev)

    def entry(self, commit: str, path: str) -> dict:
        data = self.listed[commit][path]
        out = {"type": "file", "path": path, "size": len(data),
               "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if path in self.lfs:
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self.answer(head=True)

        def do_GET(self) -> None:
            self.answer(head=False)

        def answer(self, head: bool) -> None:
            url = urlsplit(self.path)
            hub.log.append((self.command, url.path, self.headers.get("Range")))
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            try:
                if parts[:2] == ["api", "datasets"] and len(parts) >= 6 and parts[4] == "revision":
                    return self.info(f"{parts[2]}/{parts[3]}", parts[5])
                if parts[:2] == ["api", "datasets"] and len(parts) >= 6 and parts[4] == "tree":
                    recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                    return self.tree(f"{parts[2]}/{parts[3]}", parts[5], "/".join(parts[6:]), recursive)
                if parts[0] == "datasets" and len(parts) >= 6 and parts[3] == "resolve":
                    return self.file(f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]), head)
            except BrokenPipeError:
                return
            self.error(404, "EntryNotFound", "not found")

        def send_json(self, content) -> None:
            body = json.dumps(content).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def commit_of(self, repo: str, rev: str) -> str | None:
            if repo not in hub.refs:
                self.error(404, "RepoNotFound", f"Repository {repo} not found")
                return None
            commit = hub.resolve(repo, rev)
            if commit is None:
                self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return commit

        def info(self, repo: str, rev: str) -> None:
            commit = self.commit_of(repo, rev)
            if commit:
                self.send_json({"id": repo, "sha": commit, "private": False,
                                "siblings": [{"rfilename": p} for p in sorted(hub.listed[commit])]})

        def tree(self, repo: str, rev: str, folder: str, recursive: bool) -> None:
            commit = self.commit_of(repo, rev)
            if not commit:
                return
            prefix = folder.strip("/") + "/" if folder.strip("/") else ""
            out, folders = [], set()
            for path in sorted(hub.listed[commit]):
                if not path.startswith(prefix):
                    continue
                rest = path[len(prefix):]
                if "/" in rest and not recursive:
                    folders.add(prefix + rest.split("/")[0])
                    continue
                out.append(hub.entry(commit, path))
            out += [{"type": "directory", "path": f, "oid": "0" * 40} for f in sorted(folders)]
            if not out and prefix:
                return self.error(404, "EntryNotFound", f"{folder} does not exist at {rev}")
            self.send_json(out)

        def file(self, repo: str, rev: str, path: str, head: bool) -> None:
            commit = self.commit_of(repo, rev)
            if not commit:
                return
            if path not in hub.commits[commit]:
                return self.error(404, "EntryNotFound", f"{path} does not exist at {rev}")
            data = hub.commits[commit][path]
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                start = int(ranged[6:].split("-")[0])
            body = data[start:]
            self.send_response(206 if start else 200)
            entry = hub.entry(commit, path)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{entry.get("lfs", {}).get("oid", entry["oid"])}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            hanging, stop = path in hub.hangs, hub.stalls.get(path)
            if hanging or (stop is not None and start < stop):
                self.wfile.write(b"" if hanging else body[: stop - start])
                self.wfile.flush()
                hub.released.wait()  # until the test releases it (or the Hub stops): never on a timer
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler
