"""`pipeline-bench ring`: the shared-memory ring against multiprocessing.Queue and pyzmq+msgspec.

For each transport one producer and one consumer process run a plan of phases over the message sizes:
throughput (as fast as the producer can send), latency with a busy consumer (it polls without
blocking, the producer paces sends) and latency with a sleeping consumer (it blocks in its receive,
sends come every few milliseconds). One-way latency is receive time minus the send stamp inside the
message, both CLOCK_MONOTONIC. The consumer reads the last payload byte of every message; the ring
consumer gets a zero-copy view, the others get what their decode produces. CPU seconds are the two
processes' process_time over the throughput phase (all their threads, zmq's I/O thread included).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgspec
import numpy as np
import zmq

from pipeline.clock import now_ns
from pipeline.names import new_namespace
from pipeline.records import Record, Vocabulary
from pipeline.ring import RingHandle, RingSpec

TRANSPORTS = ("ring", "mp_queue", "zmq_msgspec")
SIZES = (64, 4096, 65536, 1 << 20)
BENCH = Record("bench", ("meta", np.int64), ("payload", np.uint8))  # meta: [seq, t_send_ns]
VOCAB = Vocabulary("bench", [BENCH])
BUSY_GAP_NS = 20_000
SLEEP_GAP_NS = 2_000_000


@dataclass(frozen=True, slots=True)
class Phase:
    size_bytes: int
    kind: str  # "throughput" | "busy" | "sleep"
    count: int


@dataclass(slots=True)
class Row:
    transport: str
    size_bytes: int
    msgs_per_s: float
    gb_per_s: float
    lat_busy_p50_us: float
    lat_busy_p99_us: float
    lat_sleep_p50_us: float
    lat_sleep_p99_us: float
    cpu_s: float


class ZmqMessage(msgspec.Struct, array_like=True):
    seq: int
    t_send_ns: int
    payload: bytes


def make_plan(scale: float, sizes: tuple[int, ...] = SIZES) -> list[Phase]:
    plan = []
    for size in sizes:
        throughput = int(min(100_000, max(500, 2e9 / size)) * scale)
        plan.append(Phase(size, "throughput", max(50, throughput)))
        plan.append(Phase(size, "busy", max(50, int(2000 * scale))))
        plan.append(Phase(size, "sleep", max(20, int(300 * scale))))
    return plan


# -- the transports: each gives a sender and a (blocking, non-blocking) pair of receivers ---------
# A receiver returns (t_send_ns, last payload byte) or None when non-blocking and nothing is there.


class RingTransport:
    def __init__(self, max_bytes: int) -> None:
        spec = RingSpec("bench", VOCAB, n_slots=32, slot_bytes=_round64(max_bytes + 4096))
        self.handle = RingHandle.create(new_namespace(), spec)

    def close(self) -> None:
        self.handle.unlink()

    def sender(self) -> Callable[[int, np.ndarray], None]:
        producer = self.handle.producer()

        def send(seq: int, payload: np.ndarray) -> None:
            draft = producer.reserve(BENCH, (2, len(payload)))
            draft["payload"][:] = payload
            draft["meta"][0] = seq
            draft["meta"][1] = now_ns()
            producer.commit()

        return send

    def receivers(
        self,
    ) -> tuple[Callable[[], tuple[int, int]], Callable[[], tuple[int, int] | None]]:
        consumer = self.handle.consumer()

        def read(msg) -> tuple[int, int]:  # type: ignore[no-untyped-def]
            payload = msg["payload"]
            last = int(payload[-1]) if len(payload) else 0
            t_send = int(msg["meta"][1])
            msg.release()
            return t_send, last

        def recv() -> tuple[int, int]:
            return read(consumer.recv())

        def poll() -> tuple[int, int] | None:
            msg = consumer.poll()
            return None if msg is None else read(msg)

        return recv, poll


class QueueTransport:
    def __init__(self, max_bytes: int) -> None:
        self.queue: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()

    def close(self) -> None:
        self.queue.close()

    def sender(self) -> Callable[[int, np.ndarray], None]:
        q = self.queue
        cache: dict[int, bytes] = {}

        def send(seq: int, payload: np.ndarray) -> None:
            data = cache.get(len(payload))
            if data is None:
                data = cache[len(payload)] = payload.tobytes()
            q.put((seq, now_ns(), data))

        return send

    def receivers(
        self,
    ) -> tuple[Callable[[], tuple[int, int]], Callable[[], tuple[int, int] | None]]:
        q = self.queue

        def recv() -> tuple[int, int]:
            _, t_send, data = q.get()
            return t_send, data[-1] if data else 0

        def poll() -> tuple[int, int] | None:
            try:
                _, t_send, data = q.get_nowait()
            except queue.Empty:
                return None
            return t_send, data[-1] if data else 0

        return recv, poll


class ZmqTransport:
    def __init__(self, max_bytes: int) -> None:
        self.address = f"ipc:///tmp/{new_namespace()}.zmq"

    def close(self) -> None:
        import contextlib
        import os

        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address.removeprefix("ipc://"))

    def sender(self) -> Callable[[int, np.ndarray], None]:
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.connect(self.address)
        encoder = msgspec.msgpack.Encoder()
        cache: dict[int, bytes] = {}

        def send(seq: int, payload: np.ndarray) -> None:
            data = cache.get(len(payload))
            if data is None:
                data = cache[len(payload)] = payload.tobytes()
            sock.send(encoder.encode(ZmqMessage(seq, now_ns(), data)))

        return send

    def receivers(
        self,
    ) -> tuple[Callable[[], tuple[int, int]], Callable[[], tuple[int, int] | None]]:
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.bind(self.address)
        decoder = msgspec.msgpack.Decoder(ZmqMessage)

        def read(frame: bytes) -> tuple[int, int]:
            msg = decoder.decode(frame)
            return msg.t_send_ns, msg.payload[-1] if msg.payload else 0

        def recv() -> tuple[int, int]:
            return read(sock.recv())

        def poll() -> tuple[int, int] | None:
            try:
                return read(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None

        return recv, poll


def make_transport(name: str, max_bytes: int):  # type: ignore[no-untyped-def]
    return {"ring": RingTransport, "mp_queue": QueueTransport, "zmq_msgspec": ZmqTransport}[name](
        max_bytes
    )


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


# -- the two processes ----------------------------------------------------------------------------


def run_producer(transport, plan: list[Phase], acks: multiprocessing.connection.Connection) -> None:  # type: ignore[no-untyped-def]
    send = transport.sender()
    payloads = {p.size_bytes: (np.arange(p.size_bytes) % 251).astype(np.uint8) for p in plan}
    acks.recv()  # the consumer is attached
    for phase in plan:
        payload = payloads[phase.size_bytes]
        gap_ns = {"throughput": 0, "busy": BUSY_GAP_NS, "sleep": SLEEP_GAP_NS}[phase.kind]
        cpu0 = time.process_time()
        next_ns = now_ns()
        for seq in range(phase.count):
            if gap_ns:
                while now_ns() < next_ns:
                    if gap_ns > 200_000:
                        time.sleep(max(0.0, (next_ns - now_ns()) / 1e9 - 100e-6))
                next_ns += gap_ns
            send(seq, payload)
        cpu = time.process_time() - cpu0
        acks.recv()  # the consumer has all of this phase
        acks.send(cpu)


def run_consumer(
    transport,  # type: ignore[no-untyped-def]
    plan: list[Phase],
    peer: multiprocessing.connection.Connection,
    report: multiprocessing.connection.Connection,
) -> None:
    recv, poll = transport.receivers()
    peer.send("attached")
    results = []
    for phase in plan:
        cpu0 = time.process_time()
        latencies = np.empty(phase.count, np.int64)
        t_first_send = 0
        checksum = 0
        for i in range(phase.count):
            if phase.kind == "busy":
                got = poll()
                while got is None:
                    got = poll()
            else:
                got = recv()
            t_recv = now_ns()
            t_send, last = got
            checksum += last
            if i == 0:
                t_first_send = t_send
            latencies[i] = t_recv - t_send
        elapsed_s = (now_ns() - t_first_send) / 1e9
        cpu = time.process_time() - cpu0
        peer.send("done")
        producer_cpu = peer.recv()
        results.append((elapsed_s, cpu + producer_cpu, latencies, checksum))
    report.send(results)


def bench_transport(name: str, plan: list[Phase]) -> list[Row]:
    ctx = multiprocessing.get_context("spawn")
    transport = make_transport(name, max(p.size_bytes for p in plan))
    try:
        producer_end, consumer_end = ctx.Pipe()
        report_parent, report_child = ctx.Pipe()
        consumer = ctx.Process(
            target=run_consumer, args=(transport, plan, consumer_end, report_child)
        )
        producer = ctx.Process(target=run_producer, args=(transport, plan, producer_end))
        consumer.start()
        producer.start()
        results = report_parent.recv()
        producer.join(30)
        consumer.join(30)
    finally:
        transport.close()
    return summarize(name, plan, results)


def summarize(name: str, plan: list[Phase], results: list) -> list[Row]:  # type: ignore[type-arg]
    rows: dict[int, Row] = {}
    for phase, (elapsed_s, cpu_s, latencies, _) in zip(plan, results, strict=True):
        row = rows.setdefault(phase.size_bytes, Row(name, phase.size_bytes, 0, 0, 0, 0, 0, 0, 0))
        if phase.kind == "throughput":
            row.msgs_per_s = phase.count / elapsed_s
            row.gb_per_s = row.msgs_per_s * phase.size_bytes / 1e9
            row.cpu_s = cpu_s
        else:
            p50, p99 = np.percentile(latencies / 1e3, [50, 99])
            if phase.kind == "busy":
                row.lat_busy_p50_us, row.lat_busy_p99_us = float(p50), float(p99)
            else:
                row.lat_sleep_p50_us, row.lat_sleep_p99_us = float(p50), float(p99)
    return list(rows.values())


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'transport':<12} {'size':>8} {'msgs/s':>11} {'GB/s':>7} {'busy p50':>9} {'busy p99':>9}"
        f" {'sleep p50':>10} {'sleep p99':>10} {'cpu s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r.size_bytes, TRANSPORTS.index(r.transport))):
        lines.append(
            f"{r.transport:<12} {_size(r.size_bytes):>8} {r.msgs_per_s:>11,.0f} {r.gb_per_s:>7.2f}"
            f" {r.lat_busy_p50_us:>8.1f}u {r.lat_busy_p99_us:>8.1f}u"
            f" {r.lat_sleep_p50_us:>9.1f}u {r.lat_sleep_p99_us:>9.1f}u {r.cpu_s:>7.2f}"
        )
    lines.append("")
    lines.extend(ratio_lines(rows))
    return "\n".join(lines)


def ratio_lines(rows: list[Row]) -> list[str]:
    by = {(r.transport, r.size_bytes): r for r in rows}
    out = []
    for size in sorted({r.size_bytes for r in rows}):
        ring, zmq_row = by.get(("ring", size)), by.get(("zmq_msgspec", size))
        if ring and zmq_row and zmq_row.msgs_per_s:
            out.append(
                f"ring / zmq_msgspec at {_size(size)}: {ring.msgs_per_s / zmq_row.msgs_per_s:.2f}x msgs/s,"
                f" {ring.gb_per_s / zmq_row.gb_per_s:.2f}x GB/s"
            )
    return out


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main(transports: list[str], sizes: list[int], scale: float, json_path: str | None) -> list[Row]:
    plan = make_plan(scale, tuple(sizes))
    rows: list[Row] = []
    for i, name in enumerate(transports, 1):
        print(
            f"[{i}/{len(transports)}] {name}: {len(plan)} phases ...", file=sys.stderr, flush=True
        )
        started = time.monotonic()
        rows.extend(bench_transport(name, plan))
        print(
            f"      {name} done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True
        )
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows
