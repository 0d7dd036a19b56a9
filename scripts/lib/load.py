#!/usr/bin/env python3
"""Bounded HTTPS load through the edge, for scripts/check-cluster (stdlib only).

    load.py --connect IP:PORT --host NAME --path / --ca CA.pem --rate 50 --seconds 60 \
            [--until FILE] [--max-seconds 240]

Sends --rate requests per second, each on a new TLS connection to --connect with SNI and Host
--host (what a client on the internet does), for at least --seconds and, with --until, until FILE
exists (at most --max-seconds). A request fails on any error, a timeout (10 s) or a status other
than 200. Prints one line: "requests=N ok=N failed=N" and the first failures; exits 1 on any
failure.
"""
import argparse
import os
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def one(addr, host, path, ctx):
    with socket.create_connection(addr, timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.settimeout(10)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: curl/load\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    line = data.split(b"\r\n", 1)[0].decode(errors="replace")
    if not line.startswith("HTTP/1.1 200"):
        raise RuntimeError(line or "empty response")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--connect", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--path", default="/")
    p.add_argument("--ca", required=True)
    p.add_argument("--rate", type=float, default=50)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--until")
    p.add_argument("--max-seconds", type=float, default=240)
    a = p.parse_args()
    ip, port = a.connect.rsplit(":", 1)
    addr = (ip, int(port))
    ctx = ssl.create_default_context(cafile=a.ca)
    lock = threading.Lock()
    stats = {"ok": 0, "failed": 0}
    errors = []

    def run():
        try:
            one(addr, a.host, a.path, ctx)
            with lock:
                stats["ok"] += 1
        except Exception as e:  # every kind of failure counts
            with lock:
                stats["failed"] += 1
                if len(errors) < 5:
                    errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}")

    start = time.monotonic()
    n = 0
    with ThreadPoolExecutor(max_workers=64) as pool:
        while True:
            el = time.monotonic() - start
            if el >= a.max_seconds:
                break
            if el >= a.seconds and (not a.until or os.path.exists(a.until)):
                break
            pool.submit(run)
            n += 1
            next_at = start + n / a.rate
            time.sleep(max(0.0, next_at - time.monotonic()))
    print(f"requests={n} ok={stats['ok']} failed={stats['failed']} seconds={time.monotonic() - start:.0f}")
    for e in errors:
        print("  " + e)
    sys.exit(1 if stats["failed"] else 0)


if __name__ == "__main__":
    main()
