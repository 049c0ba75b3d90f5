"""Do idle kept-alive connections hold up a llama-server's other clients? (issue 17's scale list)

Opens N connections to a running server, each kept alive after one ``GET /health`` and then left
idle (as the proxy's upstream pool and the agents' clients leave theirs), and times ``GET /slots``
on a new connection, 0 and N idle connections alternated. cpp-httplib keeps a thread per idle
kept-alive connection for up to 5 s; the pinned build adds threads on demand, so the two arms
should match.

    .venv/bin/python bench/idle_connections.py http://127.0.0.1:8080 --idle 40
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from urllib.parse import urlparse

from oc_prefix_cache import loopback


def look_ms(url: str, looks: int) -> list[float]:
    times = []
    for _ in range(looks):
        started = time.perf_counter()
        with loopback.client() as client:
            client.get(f"{url}/slots", timeout=30).raise_for_status()
        times.append((time.perf_counter() - started) * 1000)
    return times


def idle_connections(url: str, n: int) -> list[socket.socket]:
    where = urlparse(url)
    held = []
    for _ in range(n):
        conn = socket.create_connection((where.hostname or "127.0.0.1", where.port or 80))
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: ocpc\r\nConnection: keep-alive\r\n\r\n")
        conn.recv(4096)
        held.append(conn)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--idle", type=int, default=40)
    parser.add_argument("--looks", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for n in (0, args.idle):
            held = idle_connections(args.url, n)
            try:
                times = look_ms(args.url, args.looks)
            finally:
                for conn in held:
                    conn.close()
            print(
                f"{n:3d} idle kept-alive connections: /slots median {statistics.median(times):.1f} ms, "
                f"max {max(times):.1f} ms"
            )


if __name__ == "__main__":
    main()
