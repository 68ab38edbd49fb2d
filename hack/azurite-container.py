#!/usr/bin/env python3
"""Create a blob container on Azurite (object stores cannot create containers themselves).

usage: azurite-container.py http://127.0.0.1:PORT/devstoreaccount1 CONTAINER
"""
import sys

from azure.storage.blob import BlobServiceClient

ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRz6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    endpoint, container = sys.argv[1], sys.argv[2]
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={endpoint};"
    )
    client = BlobServiceClient.from_connection_string(conn)
    try:
        client.create_container(container)
    except Exception as exc:  # already exists is fine
        if "ContainerAlreadyExists" not in str(exc):
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
