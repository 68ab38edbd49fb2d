#!/usr/bin/env python3
"""Create a blob container on Azurite, since object stores cannot create containers.

usage: azurite-container.py http://127.0.0.1:PORT/devstoreaccount1 CONTAINER

Signs one "Create Container" request with Shared Key using only the standard library
(the path-style canonicalised resource Azurite expects: /<account>/<account>/<container>).
"""
import base64
import hashlib
import hmac
import http.client
import sys
import urllib.parse
from email.utils import formatdate

ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
VERSION = "2021-08-06"


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    endpoint, container = urllib.parse.urlsplit(sys.argv[1]), sys.argv[2]
    path = f"{endpoint.path.rstrip('/')}/{container}"
    date = formatdate(usegmt=True)
    to_sign = (
        "PUT\n" + "\n" * 11
        + f"x-ms-date:{date}\nx-ms-version:{VERSION}\n"
        + f"/{ACCOUNT}{path}\nrestype:container"
    )
    sig = base64.b64encode(
        hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    conn = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=10)
    conn.request(
        "PUT",
        f"{path}?restype=container",
        headers={
            "x-ms-date": date,
            "x-ms-version": VERSION,
            "Authorization": f"SharedKey {ACCOUNT}:{sig}",
            "Content-Length": "0",
        },
    )
    resp = conn.getresponse()
    body = resp.read().decode(errors="replace")
    if resp.status in (201, 409):  # created, or already there
        return 0
    print(f"create container {container}: HTTP {resp.status}\n{body}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
