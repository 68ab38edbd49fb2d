#!/usr/bin/env python3
"""A Basic-auth reverse proxy in front of a registry that has no authentication of its own
(`crane registry serve`), so a test cluster pulls with a real imagePullSecret.

    hack/registry-auth.py --listen 127.0.0.1:15000 --backend 127.0.0.1:PORT \
        --credentials FILE [--log FILE]

FILE holds one `user:password` line. A request without those credentials gets 401 and
`WWW-Authenticate: Basic realm="sealed-registry"` (what a registry client needs to retry with
them); any other request is forwarded to the backend, bodies streamed both ways (chunked
uploads included), so multi-GiB blobs never sit in memory. Every request is logged as one
JSON line (time, method, path, user or null, status) to --log (default stderr); tests read
it to see that pulls were authenticated. Python standard library only.
"""

import argparse
import base64
import hmac
import http.client
import http.server
import json
import socketserver
import sys
import threading
import time

REALM = "sealed-registry"
CHUNK = 1 << 20
# Hop-by-hop headers (RFC 9110 7.6.1) are not forwarded.
HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sealed-registry-auth"
    backend = ("127.0.0.1", 0)
    expected = b""
    log_file = sys.stderr
    log_lock = threading.Lock()

    def record(self, user, status):
        line = json.dumps(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "method": self.command,
                "path": self.path,
                "user": user,
                "status": status,
            }
        )
        with self.log_lock:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass  # record() logs every request once, as JSON

    def user(self):
        """The user of valid Basic credentials, else None."""
        value = self.headers.get("Authorization", "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            given = base64.b64decode(token.strip(), validate=True)
        except ValueError:
            return None
        if not hmac.compare_digest(given, self.expected):
            return None
        return given.split(b":", 1)[0].decode("utf-8", "replace")

    def request_body(self):
        """Yields the request body in pieces (Content-Length or chunked)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                left = size
                while left:
                    piece = self.rfile.read(min(left, CHUNK))
                    if not piece:
                        raise ConnectionError("client closed the connection mid-chunk")
                    left -= len(piece)
                    yield piece
                self.rfile.readline()  # the CRLF after each chunk
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                piece = self.rfile.read(min(left, CHUNK))
                if not piece:
                    raise ConnectionError("client closed the connection mid-body")
                left -= len(piece)
                yield piece

    def deny(self):
        body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}\n'
        # Drain what the client sent, so the connection can be reused.
        for _ in self.request_body():
            pass
        self.send_response(401)
        self.send_header("WWW-Authenticate", f'Basic realm="{REALM}"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.record(None, 401)

    def forward(self, user):
        conn = http.client.HTTPConnection(*self.backend, timeout=600)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP and name.lower() != "authorization":
                    conn.putheader(name, value)
            chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for piece in self.request_body():
                if chunked:
                    conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    conn.send(piece)
            if chunked:
                conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
            self.send_response(resp.status, resp.reason)
            length = resp.getheader("Content-Length")
            for name, value in resp.getheaders():
                if name.lower() in HOP or name.lower() == "content-length":
                    continue
                if name.lower() == "location":
                    # An absolute URL naming the backend would send the client around us.
                    for prefix in (f"http://{self.backend[0]}:{self.backend[1]}",):
                        if value.startswith(prefix):
                            value = value[len(prefix) :]
                self.send_header(name, value)
            no_body = self.command == "HEAD" or resp.status in (204, 304) or resp.status < 200
            if length is not None:
                self.send_header("Content-Length", length)
            elif not no_body:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if not no_body:
                while True:
                    piece = resp.read(CHUNK)
                    if not piece:
                        break
                    if length is None:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    else:
                        self.wfile.write(piece)
                if length is None:
                    self.wfile.write(b"0\r\n\r\n")
            self.record(user, resp.status)
        except (OSError, http.client.HTTPException) as e:
            self.record(user, f"error: {e}")
            self.close_connection = True
            raise
        finally:
            conn.close()

    def handle_any(self):
        user = self.user()
        if user is None:
            self.deny()
        else:
            self.forward(user)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = handle_any


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        print(f"registry-auth: {client_address}: {sys.exc_info()[1]}", file=sys.stderr)


def host_port(s):
    host, _, port = s.rpartition(":")
    return host, int(port)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, type=host_port, help="HOST:PORT to serve on")
    p.add_argument("--backend", required=True, type=host_port, help="HOST:PORT of the registry")
    p.add_argument("--credentials", required=True, help="a file with one user:password line")
    p.add_argument("--log", help="append the JSON request log here (default: stderr)")
    a = p.parse_args()
    with open(a.credentials, "rb") as f:
        expected = f.read().strip()
    if b":" not in expected:
        sys.exit(f"registry-auth: {a.credentials} holds no user:password line")
    Proxy.backend = a.backend
    Proxy.expected = expected
    if a.log:
        Proxy.log_file = open(a.log, "a", buffering=1)  # noqa: SIM115 (lives as long as we do)
    server = Server(a.listen, Proxy)
    print(
        f"registry-auth: http://{a.listen[0]}:{server.server_address[1]} -> "
        f"http://{a.backend[0]}:{a.backend[1]}",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
