#!/usr/bin/env python3
"""A small stand-in for the Hugging Face Hub's HTTP API, for tests (python3 stdlib only).

    python3 hack/hub-server.py --root DIR [--port N] [--host 127.0.0.1]
                               [--page-size 50] [--lfs-threshold 1048576]

Prints its URL (http://HOST:PORT) on stdout once it is listening. Repositories are the
directories DIR/<org>/<name>/ (models) and DIR/datasets/<org>/<name>/ (datasets); the files
under them are the repository's files, re-read on every request, so a test changes a repository
by editing the directory. Control files at a repository's top (never listed or served):

    .private   holds a token: requests without "Authorization: Bearer <token>" get 401
    .corrupt   every file is served with its first byte flipped (same size, same ETag)
    .flaky     holds N: the next N resolve requests answer 503 (then it counts down)
    .truncate  holds N: the next N LFS payloads break off halfway (the connection closes)

The API, as the Hub answers it:

    GET /api/{models|datasets}/<repo>/revision/<rev>         {"id", "sha": <40 hex>, ...}
    GET /api/{models|datasets}/<repo>/tree/<rev>[/<dir>]?recursive=true[&cursor=K]
        [{"type": "file"|"directory", "path", "size", "oid", "lfs"?: {"oid", "size",
          "pointerSize"}}], paged: Link: <...&cursor=K>; rel="next"
    GET /[datasets/]<repo>/resolve/<rev>/<path>
        small files: 200, ETag "<git blob sha1>", X-Repo-Commit
        LFS files (over --lfs-threshold bytes): 302 to /cdn/..., ETag and X-Linked-Etag
        "<sha256>", X-Linked-Size, X-Repo-Commit
    GET /cdn/<kind>/<repo>/<sha256>                           the LFS payload, ETag "<sha256>"

The commit of a repository is a hash of its files' paths and contents; the only revisions are
"main" and that commit. Unknown repositories answer 404 with X-Error-Code: RepoNotFound,
unknown revisions RevisionNotFound, unknown files EntryNotFound.
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTROL = {".private", ".corrupt", ".flaky", ".truncate"}
LOCK = threading.Lock()
HASHES = {}  # (path, size, mtime_ns) -> (sha256, git sha1)


def file_hashes(path):
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    with LOCK:
        if key in HASHES:
            return HASHES[key]
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % st.st_size)
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                break
            sha256.update(block)
            git.update(block)
    value = (sha256.hexdigest(), git.hexdigest())
    with LOCK:
        HASHES[key] = value
    return value


class Repo:
    def __init__(self, root, kind, repo_id):
        self.kind = kind  # "models" or "datasets"
        self.id = repo_id
        base = os.path.join(root, "datasets") if kind == "datasets" else root
        self.dir = os.path.join(base, *repo_id.split("/"))

    def exists(self):
        return os.path.isdir(self.dir)

    def take(self, name):
        """Counts a control file's number down; true while it was above zero."""
        with LOCK:
            value = self.control(name)
            if not (value and value.isdigit() and int(value) > 0):
                return False
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(str(int(value) - 1))
            return True

    def control(self, name):
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def files(self):
        """Every file as (path, abs path), sorted by path."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.dir):
            dirnames.sort()
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.dir).replace(os.sep, "/")
                if rel in CONTROL:
                    continue
                out.append((rel, full))
        out.sort()
        return out

    def commit(self):
        h = hashlib.sha1()
        for rel, full in self.files():
            h.update(rel.encode() + b"\0" + file_hashes(full)[0].encode() + b"\n")
        return h.hexdigest()

    def tree(self, lfs_threshold):
        """Files and directories, as the Hub lists them recursively."""
        entries = {}
        for rel, full in self.files():
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                entries.setdefault(d, {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
            size = os.path.getsize(full)
            sha256, git = file_hashes(full)
            entry = {"type": "file", "oid": git, "size": size, "path": rel}
            if size > lfs_threshold:
                entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
            entries[rel] = entry
        return [entries[k] for k in sorted(entries)]


class Handler(BaseHTTPRequestHandler):
    server_version = "hub-server/1"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet; tokens never reach a log anyway
        pass

    # --- helpers -----------------------------------------------------------------------------

    def send(self, status, body=b"", headers=None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self.send(status, body, {"X-Error-Code": code, "X-Error-Message": message})

    def authorized(self, repo):
        token = repo.control(".private")
        if token is None:
            return True
        return self.headers.get("Authorization", "") == "Bearer " + token

    def open_repo(self, kind, repo_id):
        repo = Repo(self.server.root, kind, repo_id)
        if not repo.exists():
            self.error(404, "RepoNotFound", "Repository not found")
            return None
        if not self.authorized(repo):
            self.error(401, "RepoNotFound", "Invalid username or password.")
            return None
        return repo

    def commit_for(self, repo, rev):
        commit = repo.commit()
        if rev in ("main", commit):
            return commit
        self.error(404, "RevisionNotFound", "Invalid rev id: " + rev)
        return None

    # --- routes ------------------------------------------------------------------------------

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query)
        parts = [urllib.parse.unquote(p) for p in parsed.path.split("/")[1:]]
        try:
            if parts[:1] == ["api"] and len(parts) >= 6 and parts[1] in ("models", "datasets"):
                return self.api(parts[1], parts[2:], query)
            if parts[:1] == ["cdn"] and len(parts) == 5:
                return self.cdn(parts[1], parts[2] + "/" + parts[3], parts[4])
            kind = "models"
            if parts[:1] == ["datasets"]:
                kind, parts = "datasets", parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve":
                return self.resolve(kind, parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
            self.error(404, "EntryNotFound", "no such route")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def api(self, kind, rest, query):
        # rest = [org, name, "revision"|"tree", rev, *path]
        repo = self.open_repo(kind, rest[0] + "/" + rest[1])
        if repo is None:
            return
        what, rev = rest[2], rest[3]
        commit = self.commit_for(repo, rev)
        if commit is None:
            return
        if what == "revision":
            body = {"id": repo.id, "sha": commit, "private": repo.control(".private") is not None}
            return self.send(200, json.dumps(body).encode())
        if what != "tree":
            return self.error(404, "EntryNotFound", "no such route")
        sub = "/".join(rest[4:]).strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries = repo.tree(self.server.lfs_threshold)
        if sub:
            entries = [e for e in entries if e["path"].startswith(sub + "/")]
        if not recursive:
            depth = sub.count("/") + 1 if sub else 0
            entries = [e for e in entries if e["path"].count("/") == depth]
        start = int(query.get("cursor", ["0"])[0] or 0)
        page = entries[start : start + self.server.page_size]
        headers = {}
        if start + self.server.page_size < len(entries):
            q = {k: v[0] for k, v in query.items()}
            q["cursor"] = str(start + self.server.page_size)
            url = "%s%s?%s" % (self.server.url, urllib.parse.urlsplit(self.path).path, urllib.parse.urlencode(q))
            headers["Link"] = '<%s>; rel="next"' % url
        self.send(200, json.dumps(page).encode(), headers)

    def resolve(self, kind, repo_id, rev, path):
        repo = self.open_repo(kind, repo_id)
        if repo is None:
            return
        if repo.take(".flaky"):
            return self.error(503, "ServiceUnavailable", "try again")
        commit = self.commit_for(repo, rev)
        if commit is None:
            return
        files = dict(repo.files())
        if path not in files:
            return self.error(404, "EntryNotFound", "Entry not found")
        full = files[path]
        size = os.path.getsize(full)
        sha256, git = file_hashes(full)
        common = {"X-Repo-Commit": commit}
        if size > self.server.lfs_threshold:
            location = "%s/cdn/%s/%s/%s" % (self.server.url, kind, urllib.parse.quote(repo_id), sha256)
            headers = dict(common, **{
                "Location": location,
                "ETag": '"%s"' % sha256,
                "X-Linked-Etag": '"%s"' % sha256,
                "X-Linked-Size": str(size),
            })
            return self.send(302, b"", headers)
        with open(full, "rb") as f:
            body = f.read()
        if body and repo.control(".corrupt") is not None:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        self.send(200, body, dict(common, ETag='"%s"' % git), "application/octet-stream")

    def cdn(self, kind, repo_id, sha256):
        # Like a signed CDN URL: no Authorization needed (and none should arrive).
        repo = Repo(self.server.root, kind, repo_id)
        if not repo.exists():
            return self.error(404, "EntryNotFound", "no such object")
        for rel, full in repo.files():
            if file_hashes(full)[0] == sha256:
                break
        else:
            return self.error(404, "EntryNotFound", "no such object")
        size = os.path.getsize(full)
        corrupt = repo.control(".corrupt") is not None
        stop_at = size // 2 if repo.take(".truncate") else None
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", '"%s"' % sha256)
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = 0
        with open(full, "rb") as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                if corrupt and sent == 0:
                    block = bytes([block[0] ^ 0xFF]) + block[1:]
                if stop_at is not None and sent + len(block) > stop_at:
                    self.wfile.write(block[: stop_at - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                sent += len(block)
                self.wfile.write(block)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="directory of repositories: ROOT/<org>/<name>/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--page-size", type=int, default=50, help="tree entries per page")
    p.add_argument("--lfs-threshold", type=int, default=1 << 20, help="files over this many bytes are LFS files")
    args = p.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.root = os.path.abspath(args.root)
    server.page_size = max(1, args.page_size)
    server.lfs_threshold = args.lfs_threshold
    server.url = "http://%s:%d" % (args.host, server.server_address[1])
    print(server.url, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
