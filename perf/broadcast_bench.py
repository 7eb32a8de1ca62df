"""`pipeline-bench broadcast`: one message to N reader processes through the broadcast ring,
against the same message sent on N single-consumer rings, side by side in one run.

Per reader count and size: throughput (the writer sends as fast as the slowest reader lets it;
measured from the first send to the last reader's last receive) and one-way latency to the last
reader with sleeping readers (a send every 2 ms; receive time minus the send stamp, both
CLOCK_MONOTONIC). Every reader blocks in its receive (no spinning), as execute ranks do.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pipeline.broadcast import BroadcastHandle, BroadcastSpec
from pipeline.clock import now_ns
from pipeline.names import new_namespace
from pipeline.records import Record, Vocabulary
from pipeline.ring import RingHandle, RingSpec

BENCH = Record("bench", ("meta", np.int64), ("payload", np.uint8))  # meta: [seq, t_send_ns]
VOCAB = Vocabulary("bench", [BENCH])
KINDS = ("broadcast", "rings")
SLEEP_GAP_S = 0.002
CHUNK_BYTES = 256 * 1024


@dataclass(slots=True)
class Row:
    kind: str
    readers: int
    size_bytes: int
    msgs_per_s: float
    lat_p50_us: float
    lat_p99_us: float


def _read(kind: str, handle: Any, count: int, latency_count: int, results: Any) -> None:
    """Receive count + latency_count messages; report the last throughput receive time and the
    latencies of the rest."""
    if kind == "broadcast":
        reader = handle.reader_end()

        def recv() -> int:
            return int(reader.recv()[1]["meta"][1])
    else:
        reader = handle.consumer(spin_s=0.0)

        def recv() -> int:
            with reader.recv() as message:
                return int(message["meta"][1])

    with reader:
        for _ in range(count):
            recv()
        last_ns = now_ns()
        latencies = []
        for _ in range(latency_count):
            sent = recv()
            latencies.append((now_ns() - sent) / 1e3)
    results.put((last_ns, latencies))


def bench(kind: str, readers: int, size: int, count: int, latency_count: int) -> Row:
    ctx = multiprocessing.get_context("spawn")
    namespace = new_namespace()
    slot = max(CHUNK_BYTES, -(-(size + 256) // 64) * 64)
    if kind == "broadcast":
        handle = BroadcastHandle.create(namespace, BroadcastSpec("b", VOCAB, readers, 8, slot))
        ends = [handle.for_reader(k) for k in range(readers)]
        handles: list[Any] = [handle]
    else:
        handles = [
            RingHandle.create(namespace, RingSpec(f"r{k}", VOCAB, 8, slot)) for k in range(readers)
        ]
        ends = handles
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_read, args=(kind, end, count, latency_count, results)) for end in ends
    ]
    for proc in procs:
        proc.start()
    try:
        if kind == "broadcast":
            writers: list[Any] = [handles[0].writer()]
        else:
            writers = [h.producer(spin_s=0.0) for h in handles]
        time.sleep(1.0)  # the readers have started and attached
        payload = np.zeros(size, np.uint8)
        meta = np.zeros(2, np.int64)
        first_ns = now_ns()
        for seq in range(count + latency_count):
            if seq >= count:
                time.sleep(SLEEP_GAP_S)
            meta[0], meta[1] = seq, now_ns()
            for writer in writers:
                writer.send(BENCH, {"meta": meta, "payload": payload}, timeout_s=30)
        reports = [results.get(timeout=60) for _ in procs]
        for writer in writers:
            writer.close()
    finally:
        for proc in procs:
            proc.join(10)
        for h in handles:
            h.unlink()
    last_ns = max(r[0] for r in reports)
    worst = np.max(np.array([r[1] for r in reports]), axis=0)  # the last reader to get each one
    return Row(
        kind,
        readers,
        size,
        count / ((last_ns - first_ns) / 1e9),
        float(np.percentile(worst, 50)),
        float(np.percentile(worst, 99)),
    )


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'readers':>7} {'size':>8} {'kind':<10} {'msg/s':>9} {'p50 us':>8} {'p99 us':>8} {'x rings':>8}",
        "-" * 64,
    ]
    rings = {(r.readers, r.size_bytes): r for r in rows if r.kind == "rings"}
    for r in rows:
        base = rings.get((r.readers, r.size_bytes))
        ratio = f"{r.msgs_per_s / base.msgs_per_s:.2f}x" if base else "-"
        lines.append(
            f"{r.readers:>7} {r.size_bytes:>8} {r.kind:<10} {r.msgs_per_s:>9.0f} "
            f"{r.lat_p50_us:>8.0f} {r.lat_p99_us:>8.0f} {ratio:>8}"
        )
    return "\n".join(lines)


def main(readers: list[int], sizes: list[int], scale: float, json_path: str | None) -> list[Row]:
    rows = []
    for n in readers:
        for size in sizes:
            count = max(50, int(2000 * scale * min(1.0, 65536 / max(size, 1))))
            for kind in KINDS:  # interleaved: each pair runs back to back
                print(f"{kind}: {n} readers, {size} bytes ...", file=sys.stderr, flush=True)
                rows.append(bench(kind, n, size, count, max(20, int(200 * scale))))
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return rows
