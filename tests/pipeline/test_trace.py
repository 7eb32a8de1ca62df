"""Trace buffers: the reader gets what was written since it last looked, in order, overwritten spans
dropped; gauges published by an actor reach the owner."""

from __future__ import annotations

import time

from pipeline.actor import ActorSpec
from pipeline.names import new_namespace
from pipeline.ring import RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig
from pipeline.trace import TraceBuffer, TraceHandle
from tests.pipeline.peers import VOCAB


def test_reader_sees_new_spans_once_and_the_latest_after_overwrite():
    handle = TraceHandle.create(new_namespace(), "x", capacity=8)
    writer, reader = handle.attach(), handle.attach()
    handle.unlink()
    try:
        for i in range(3):
            writer.record(kind=1, t_start_ns=i, t_end_ns=i + 10, batch=i, cpu_ns=7)
        spans = reader.read_new()
        assert spans["batch"].tolist() == [0, 1, 2] and spans["cpu_ns"].tolist() == [7, 7, 7]
        assert len(reader.read_new()) == 0
        for i in range(20):  # more than the capacity: only the last 8 survive
            writer.record(kind=2, t_start_ns=i, t_end_ns=i + 1, batch=100 + i)
        spans = reader.read_new()
        assert spans["batch"].tolist() == list(range(112, 120))
        assert (spans["kind"] == 2).all()
    finally:
        writer.close()
        reader.close()


def test_a_local_buffer_keeps_the_owners_own_spans_with_their_links():
    buffer = TraceBuffer.local(capacity=4)
    try:
        for i in range(6):
            buffer.record(kind=6, t_start_ns=10 * i, t_end_ns=10 * i + 3, lead_ns=2, link=40 + i)
        spans = buffer.read_new()
        assert spans["link"].tolist() == [42, 43, 44, 45]  # the last 4
        assert (spans["lead_ns"] == 2).all() and len(buffer.read_new()) == 0
        buffer.record(kind=1, t_start_ns=0, t_end_ns=1)
        assert buffer.read_new()["link"].tolist() == [-1]  # unlinked work
    finally:
        buffer.close()


def test_actor_spans_and_gauges_reach_the_owner():
    rings = [RingSpec("x", VOCAB, 2, 256)]
    actors = [ActorSpec("worker", "tests.pipeline.peers:Reporter", inboxes=("x",))]
    with Supervisor(
        rings, actors, SupervisorConfig(log_format="json"), owner_outboxes=("x",)
    ) as sup:
        deadline = time.monotonic() + 10
        while sup.gauges("worker")[:2] != [42.0, 0.5] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sup.gauges("worker")[:2] == [42.0, 0.5]
        spans = sup.traces["worker"].read_new()
        assert len(spans) == 1 and spans["kind"][0] == 9 and spans["tokens"][0] == 5
