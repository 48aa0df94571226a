"""
A dataset host on 127.0.0.1 for the download tests and benchmark: parquet shards served from
memory, the way the real host serves them (a redirect to a "CDN" path that honours Range), and
misbehaving on request:

    drop_once      shards whose first GET is cut off mid-file (the connection closed)
    fail_503       how many requests answer 503 before any is served
    truncate_once  shards whose first GET sends only part of the file, with status 200 and a
                   Content-Length that matches what is sent (only the parquet check can tell)
    missing        shards answered with 404

Every request is recorded (method, path, Range) so a test can check what was asked, and where.
"""

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq


def parquet_bytes(texts, row_group_size=16) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), sink, row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


class ShardServer:
    def __init__(self, files: dict[str, bytes], *, drop_once=(), fail_503=0, truncate_once=(), missing=()):
        self.files, self.lock, self.requests = dict(files), threading.Lock(), []
        self.drop_once, self.truncate_once, self.missing = set(drop_once), set(truncate_once), set(missing)
        self.fail_503 = fail_503
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server.answer(self, head=True)

            def do_GET(self):
                server.answer(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/resolve/main"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def count(self, method="GET", name=None) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and (name is None or p.endswith("/" + name)))

    def _status(self, handler, code, body=b"", headers=()):
        handler.send_response(code)
        for key, value in headers:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def answer(self, h, head: bool):
        method = "HEAD" if head else "GET"
        with self.lock:
            self.requests.append((method, h.path, h.headers.get("Range")))
            fail = self.fail_503 > 0
            self.fail_503 -= fail
        if fail:
            return self._status(h, 503, b"busy")
        if h.path.startswith("/resolve/main/"):  # the host: a redirect to the CDN, as the real one does
            name = h.path.rsplit("/", 1)[-1]
            if name in self.missing or name not in self.files:
                return self._status(h, 404, b"not found")
            return self._status(h, 302, headers=[("Location", f"/cdn/{name}")])
        name = h.path.removeprefix("/cdn/")
        if name not in self.files:
            return self._status(h, 404, b"not found")
        data = self.files[name]
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or "")
        if match:
            start = int(match.group(1))
            if start >= len(data):
                return self._status(h, 416, headers=[("Content-Range", f"bytes */{len(data)}")])
        if head:
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Accept-Ranges", "bytes")
            return h.end_headers()
        with self.lock:
            drop = name in self.drop_once
            truncate = name in self.truncate_once and not drop
            self.drop_once.discard(name)
            if truncate:
                self.truncate_once.discard(name)
        body = data[start:]
        h.send_response(206 if match else 200)
        if match:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if truncate:  # a short file, honestly labelled: only the parquet check can tell
            body = body[: len(body) // 2]
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if drop:  # half the body, then the connection goes away
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            try:
                h.connection.shutdown(2)
            except OSError:  # the client went first
                pass
            return
        h.wfile.write(body)
