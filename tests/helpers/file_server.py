"""A plain file server on 127.0.0.1 for the weights-fetching tests: ``GET`` / ``HEAD`` of the files put under paths,
``Range`` requests answered 206 (416 past the end), and faults:

* :meth:`FileServer.redirect`: a path answers ``302`` to another URL (another path, another server, another scheme);
* :meth:`FileServer.stall`: a file's body stops after a number of bytes and hangs until :meth:`FileServer.release`
  (a download interrupted part-way, as when its process is killed);
* :meth:`FileServer.cut`: a file's body ends after a number of bytes, without a ``Content-Length`` (the server
  closes the connection: a file served short);
* :meth:`FileServer.put` again: other bytes under the same path (a file changed upstream).

:attr:`FileServer.log` records every request (method, path, Range header), :attr:`FileServer.credentials` its
``Authorization`` header (None when absent)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FileServer:
    def __init__(self) -> None:
        self.content: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.stalls: dict[str, int] = {}
        self.cuts: dict[str, int] = {}
        self.released = threading.Event()
        self.log: list[tuple[str, str, str | None]] = []
        self.credentials: list[str | None] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FileServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    def put(self, path: str, data: bytes) -> str:
        self.content[path] = data
        return self.url + path

    def redirect(self, path: str, to: str) -> str:
        self.redirects[path] = to
        return self.url + path

    def stall(self, path: str, after: int) -> None:
        self.stalls[path] = after
        self.released.clear()

    def cut(self, path: str, after: int) -> None:
        self.cuts[path] = after

    def release(self) -> None:
        self.stalls.clear()
        self.released.set()


def _handler(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self.answer(head=True)

        def do_GET(self) -> None:
            self.answer(head=False)

        def answer(self, head: bool) -> None:
            path = urlsplit(self.path).path
            ranged = self.headers.get("Range")
            server.log.append((self.command, path, ranged))
            server.credentials.append(self.headers.get("Authorization"))
            try:
                if path in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path not in server.content:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.file(path, server.content[path], ranged, head)
            except (BrokenPipeError, ConnectionResetError):
                return

        def file(self, path: str, data: bytes, ranged: str | None, head: bool) -> None:
            start = int(ranged[6:].split("-")[0]) if ranged and ranged.startswith("bytes=") else 0
            if start >= len(data) and start:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[start:]
            cut = server.cuts.get(path)
            self.send_response(206 if start else 200)
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            if cut is None:
                self.send_header("Content-Length", str(len(body)))
            else:  # no length: the body ends where the connection closes
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if head:
                return
            if cut is not None:
                self.wfile.write(body[: max(cut - start, 0)])
                return
            stop = server.stalls.get(path)
            if stop is not None and start < stop:
                self.wfile.write(body[: stop - start])
                self.wfile.flush()
                server.released.wait()  # until the test releases it (or the server stops): never on a timer
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler
