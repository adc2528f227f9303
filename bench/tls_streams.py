"""Wall clock on loopback: an authenticated link (mutual TLS 1.3, ``meshlearn.net.links``) against
a plain framed TCP stream (``dist.links = "tcp"``), both reading through ``net/frames.py``.

A peer process dials this one and, for each frame size (1 KB, 100 KB, 4 MB), sends a burst of
frames (throughput: payload MB/s from the first frame to the last at the receiver), then plays
ping-pong (latency: the median round trip of one frame out and a 16-byte frame back). Plain and
TLS alternate, ``--repeats`` times, so both see the same machine load; each number is the median
over the repeats. The load average is recorded.

    OMP_NUM_THREADS=1 python bench/tls_streams.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table, write_results

from meshlearn.net.frames import FramedStream, frame
from meshlearn.net.keys import Credentials, create_run
from meshlearn.net.links import LinkGate, dial_link
from meshlearn.net.tls import RunTls

SIZES = {"1 KB": 1 << 10, "100 KB": 100 << 10, "4 MB": 4 << 20}
BURST_BYTES = 64 << 20  # payload per throughput burst (at least 16 frames)
PINGS = {"1 KB": 2000, "100 KB": 400, "4 MB": 16}
LINK = ("r0s0", "r0s1")
OWNERS = {"r0s0": "alice", "r0s1": "bob"}
HEADER_ROOM = 1024
BOUND = (4 << 20) + 4096


def _burst(size: int) -> int:
    return max(16, BURST_BYTES // size)


def _message(size: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame(b"", bytes(size))), dtype=torch.uint8)


def peer(mode: str, port: int, keys: str) -> None:
    """The other end: dial, then per size a burst of frames and ``PINGS`` round trips."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    if mode == "tls":
        tls = RunTls(Credentials.in_folder(Path(keys), "alice"))
        stream = dial_link(sock, tls, LINK, OWNERS, time.monotonic() + 60, HEADER_ROOM)
    else:
        stream = FramedStream(sock, "r0s0->r0s1", HEADER_ROOM)
    stream.set_timeout(120)
    for label, size in SIZES.items():
        message = _message(size)
        for _ in range(_burst(size)):
            stream.send(message)
        stream.read_frame(BOUND)  # the receiver has them all
        for _ in range(PINGS[label]):
            stream.send(message)
            stream.read_frame(BOUND)
    stream.close()


def measure(mode: str, keys: Path) -> dict[str, dict[str, float]]:
    listener = socket.create_server(("127.0.0.1", 0))
    child = mp.get_context("spawn").Process(target=peer, args=(mode, listener.getsockname()[1], str(keys)))
    child.start()
    listener.settimeout(120)
    sock, _ = listener.accept()
    listener.close()
    if mode == "tls":
        gate = LinkGate(RunTls(Credentials.in_folder(keys, "bob")), {LINK}, OWNERS, HEADER_ROOM)
        stream = gate.authenticate(sock, time.monotonic() + 60)
    else:
        stream = FramedStream(sock, "r0s0->r0s1", HEADER_ROOM)
    stream.set_timeout(120)
    ack = _message(0)
    result = {}
    for label, size in SIZES.items():
        count = _burst(size)
        stream.read_frame(BOUND)
        start = time.perf_counter()  # from the first frame in, so the dial and the spawn do not count
        for _ in range(count - 1):
            stream.read_frame(BOUND)
        elapsed = time.perf_counter() - start
        stream.send(ack)
        trips = []
        for _ in range(PINGS[label]):
            t0 = time.perf_counter()
            stream.read_frame(BOUND)
            stream.send(ack)
            trips.append(time.perf_counter() - t0)
        # each trip as the receiver sees it: from one echo sent to the next frame fully read
        result[label] = {"mb_per_s": (count - 1) * size / elapsed / 1e6,
                         "round_trip_us": statistics.median(trips) * 1e6}
    child.join(timeout=120)
    stream.close()
    if child.exitcode != 0:
        raise SystemExit(f"the {mode} peer failed (exit {child.exitcode})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys = Path(tempfile.mkdtemp(prefix="meshlearn-tls-bench-")) / "keys"
    create_run(keys, ["alice", "bob"], "bench")
    load_before = os.getloadavg()
    runs = {"plain": [], "tls": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(measure(mode, keys))
    rows = []
    for label in SIZES:
        row = {"frame": label}
        for mode, results in runs.items():
            row[f"{mode}_mb_per_s"] = statistics.median(r[label]["mb_per_s"] for r in results)
            row[f"{mode}_round_trip_us"] = statistics.median(r[label]["round_trip_us"] for r in results)
        row["throughput_ratio"] = row["tls_mb_per_s"] / row["plain_mb_per_s"]
        row["round_trip_ratio"] = row["tls_round_trip_us"] / row["plain_round_trip_us"]
        rows.append(row)
    payload = {"repeats": args.repeats, "burst_bytes": BURST_BYTES, "pings": PINGS, "rows": rows,
               "runs": runs, "cpu_count": os.cpu_count(), "load_avg_before": load_before,
               "load_avg_after": os.getloadavg(), "openssl": ssl.OPENSSL_VERSION,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    table = markdown_table(rows, [("frame", "frame", ""), ("plain_mb_per_s", "plain MB/s", ".0f"),
                                  ("tls_mb_per_s", "TLS MB/s", ".0f"),
                                  ("throughput_ratio", "TLS ÷ plain", ".2f"),
                                  ("plain_round_trip_us", "plain round trip µs", ".0f"),
                                  ("tls_round_trip_us", "TLS round trip µs", ".0f"),
                                  ("round_trip_ratio", "TLS ÷ plain", ".2f")])
    write_results("tls_streams", payload,
                  f"Authenticated (mutual TLS 1.3, {payload['openssl']}) vs plain framed TCP streams on "
                  f"loopback, one sending process and one receiving, median of {args.repeats} alternating "
                  f"repeats; burst of {BURST_BYTES >> 20} MB per size; round trip = one frame out, a "
                  f"16-byte frame back. {os.cpu_count()} cores, load average {load_before[0]:.1f} at start, "
                  f"{payload['load_avg_after'][0]:.1f} at the end; "
                  f"`OMP_NUM_THREADS=1 python bench/tls_streams.py`\n\n{table}")


if __name__ == "__main__":
    main()
