"""Acceptance tests of the bmqp listener with the official BlazingMQ Python SDK (blazingmq 1.2.2).

Each test talks to a REAL running cluster through its BlazingMQ client-protocol listeners:
post/ACK/receive/confirm with properties, 10,000 messages without loss, interoperation with
our own protocol (`bmqctl produce` / `bmqctl consume` and their self-checking payloads,
bmqpayload.py), redelivery of an unconfirmed message, refusal of an unknown domain, and
(marked `destructive`, run alone with `pytest -m destructive` on a cluster of its own) a
SIGKILL of the queue's primary while the SDK produces. `test_bmqpayload_self_check` needs no
broker.

Environment (see conftest.py): BMQ_BROKER_URI, BMQ_SDK_BROKERS, BMQ_SDK_DOMAIN, BMQCTL,
BMQ_BROKERS, BMQ_TEST_NODES. Run: `target/sdk-venv/bin/python -B -m pytest tests/sdk`
(scripts/sdk-venv.sh makes the venv).
"""

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import blazingmq
import pytest

import bmqpayload

# Every wait of a test is bounded by this many seconds.
WAIT = 60.0
# The SDK's own request timeouts (it logs a warning below 300 s; that is expected).
SDK_TIMEOUTS = blazingmq.Timeouts(
    connect_timeout=30.0,
    disconnect_timeout=30.0,
    open_queue_timeout=30.0,
    configure_queue_timeout=30.0,
    close_queue_timeout=30.0,
)
SUCCESS = blazingmq.AckStatus.SUCCESS


def start_session(broker, on_message=None):
    """A started SDK session connected to `broker` (tcp://host:port); stop() it in a finally."""
    return blazingmq.Session(
        blazingmq.session_events.log_session_event,
        on_message=on_message,
        broker=broker,
        timeout=SDK_TIMEOUTS,
    )


class Inbox:
    """Collects the messages delivered to a session (its on_message), confirming them or not.

    on_message runs on an SDK thread: it only records and confirms, never calls the session.
    """

    def __init__(self, confirm=True):
        self.confirm = confirm
        self.cond = threading.Condition()
        self.messages = []  # every delivery, in order
        self.counts = collections.Counter()  # payload -> deliveries
        self.missing = set()  # expected payloads not delivered yet (see expect)

    def on_message(self, msg, handle):
        if self.confirm:
            handle.confirm()
        with self.cond:
            self.messages.append(msg)
            self.counts[msg.data] += 1
            self.missing.discard(msg.data)
            self.cond.notify_all()

    def expect(self, payloads):
        """Declares the payloads that wait_all waits for."""
        with self.cond:
            self.missing = set(payloads) - set(self.counts)

    def wait_all(self, timeout=WAIT):
        """True once every expected payload was delivered; False at the timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.missing, timeout)

    def wait_distinct(self, n, timeout=WAIT):
        """True once n distinct payloads were delivered; False at the timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.counts) >= n, timeout)

    def snapshot(self):
        with self.cond:
            return list(self.messages), collections.Counter(self.counts)


class Acks:
    """Records the ACK of each post, by a key chosen by the test (on_ack=acks.callback(key))."""

    def __init__(self):
        self.cond = threading.Condition()
        self.status = {}  # key -> AckStatus
        self.text = {}  # key -> repr(ack), for failure messages

    def callback(self, key):
        def on_ack(ack):
            with self.cond:
                self.status[key] = ack.status
                self.text[key] = repr(ack)
                self.cond.notify_all()

        return on_ack

    def wait(self, n, timeout=WAIT):
        """True once n ACKs arrived; False at the timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.status) >= n, timeout)

    def failures(self):
        """{key: repr(ack)} of the ACKs that are not SUCCESS."""
        with self.cond:
            return {k: self.text[k] for k, s in self.status.items() if s != SUCCESS}


def post_all(session, uri, payloads, acks):
    """Posts every payload with an on_ack keyed by its index; asserts all ACKed SUCCESS."""
    for i, payload in enumerate(payloads):
        session.post(uri, payload, on_ack=acks.callback(i))
    assert acks.wait(len(payloads)), (
        f"only {len(acks.status)} of {len(payloads)} posts were ACKed within {WAIT:.0f} s"
    )
    failures = acks.failures()
    assert not failures, (
        f"{len(failures)} of {len(payloads)} ACKs are not SUCCESS, e.g. "
        f"{list(failures.values())[:5]}"
    )


def run_bmqctl(args, timeout):
    """Runs bmqctl with the inherited environment; returns (CompletedProcess, parsed JSON)."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(args)} still running after {timeout:.0f} s\n"
                    f"stdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = None
    return proc, report


def describe(proc):
    return (
        f"command {' '.join(proc.args)} exited {proc.returncode}\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )


# --------------------------------------------------------------------------------------------


def test_bmqpayload_self_check():
    # No broker: encode/verify round-trips at sizes around the header and word boundaries,
    # every single-byte corruption and truncation is detected, and the known vector holds.
    for size in (0, 1, 31, 32, 33, 39, 40, 41, 1024, 65537):
        p = bmqpayload.encode(42, 7, size)
        assert len(p) == max(size, 32), f"size {size}: encoded {len(p)} bytes"
        assert bmqpayload.verify(p) == (42, 7), f"size {size} does not verify"
    p = bmqpayload.encode(9, 3, 80)
    for i in range(len(p)):
        bad = bytearray(p)
        bad[i] ^= 0x01
        with pytest.raises(ValueError):
            bmqpayload.verify(bytes(bad))
    with pytest.raises(ValueError, match="corrupt at byte 50"):
        bmqpayload.verify(p[:50] + bytes([p[50] ^ 0x80]) + p[51:])
    with pytest.raises(ValueError, match="says 80 bytes, payload has 79"):
        bmqpayload.verify(p[:79])
    with pytest.raises(ValueError, match="shorter"):
        bmqpayload.verify(p[:10])
    with pytest.raises(ValueError, match="magic"):
        bmqpayload.verify(bytes(40))
    assert bmqpayload.encode(1, 1, 100)[32:] != bmqpayload.encode(1, 2, 100)[32:]
    # Computed with this module and with a standalone copy of bmqctl/src/payload.rs.
    assert bmqpayload.encode(1, 2, 48).hex() == (
        "424d515000000000000000010000000000000002000000308b512fa890836098"
        "ea529b77cc37c947d353d3ba6f381b2d"
    )


def test_post_ack_receive_confirm_with_properties(broker_uri, queue_uri):
    # One session reads and writes: the post is ACKed SUCCESS, the message comes back with its
    # data and properties, and once confirmed it is not redelivered to a new reader.
    payload = b"hello from the BlazingMQ SDK " + uuid.uuid4().hex.encode()
    inbox, acks = Inbox(), Acks()
    session = start_session(broker_uri, inbox.on_message)
    try:
        session.open_queue(queue_uri, read=True, write=True)
        session.post(queue_uri, payload, properties={"k": "v"}, on_ack=acks.callback(0))
        assert acks.wait(1), f"no ACK within {WAIT:.0f} s"
        assert acks.status[0] == SUCCESS, f"ACK is not SUCCESS: {acks.text[0]}"
        assert inbox.wait_distinct(1), f"the message was not delivered within {WAIT:.0f} s"
        msg = inbox.messages[0]
        assert msg.data == payload, f"delivered data {msg.data!r} != posted {payload!r}"
        assert msg.properties == {"k": "v"}, f"delivered properties {msg.properties!r}"
        assert msg.queue_uri == queue_uri, f"delivered for {msg.queue_uri!r}"
        session.close_queue(queue_uri)
    finally:
        session.stop()

    again = Inbox()
    session = start_session(broker_uri, again.on_message)
    try:
        session.open_queue(queue_uri, read=True)
        redelivered = again.wait_distinct(1, timeout=2.0)
        assert not redelivered, f"a confirmed message was redelivered: {again.messages}"
        session.close_queue(queue_uri)
    finally:
        session.stop()


def test_typed_properties_and_zlib_compression_round_trip(broker_uri, queue_uri, nodes):
    # Every property type the SDK has comes back with its type (the broker carries the type
    # beside the value), and a producer that compresses (zlib; the SDK compresses data of
    # 1 KiB and more) is read back as the bytes it posted.
    properties = {
        "string": "text",
        "bool": True,
        "int64": -(1 << 40),
        "int32": 70000,
        "short": -300,
        "char": b"A",
        "binary": b"\x00\xff\x10",
    }
    overrides = {
        "int32": blazingmq.PropertyType.INT32,
        "short": blazingmq.PropertyType.SHORT,
        "char": blazingmq.PropertyType.CHAR,
    }
    payload = (b"compressible " * 400) + uuid.uuid4().hex.encode()
    inflated_before = metric_sum(nodes[0].admin, "bmq_bmqp_puts_decompressed_total")
    inbox, acks = Inbox(), Acks()
    session = blazingmq.Session(
        blazingmq.session_events.log_session_event,
        on_message=inbox.on_message,
        broker=broker_uri,
        timeout=SDK_TIMEOUTS,
        message_compression_algorithm=blazingmq.CompressionAlgorithmType.ZLIB,
    )
    try:
        session.open_queue(queue_uri, read=True, write=True)
        session.post(
            queue_uri,
            payload,
            properties=properties,
            property_type_overrides=overrides,
            on_ack=acks.callback(0),
        )
        assert acks.wait(1), f"no ACK within {WAIT:.0f} s"
        assert acks.status[0] == SUCCESS, f"ACK is not SUCCESS: {acks.text[0]}"
        assert inbox.wait_distinct(1), f"the message was not delivered within {WAIT:.0f} s"
        msg = inbox.messages[0]
        assert msg.data == payload, f"delivered {len(msg.data)} bytes, posted {len(payload)}"
        got = dict(msg.properties)
        want = dict(properties)
        assert got == want, f"delivered properties {got!r} != posted {want!r}"
        types = dict(msg.property_types)
        assert types["int32"] == blazingmq.PropertyType.INT32, types
        assert types["short"] == blazingmq.PropertyType.SHORT, types
        assert types["char"] == blazingmq.PropertyType.CHAR, types
        assert types["int64"] == blazingmq.PropertyType.INT64, types
        assert types["binary"] == blazingmq.PropertyType.BINARY, types
        inflated = metric_sum(nodes[0].admin, "bmq_bmqp_puts_decompressed_total")
        assert inflated > inflated_before, "the SDK's PUT did not arrive compressed"
        session.close_queue(queue_uri)
    finally:
        session.stop()


def metric_sum(admin, name):
    """The sum of every sample of metric `name` in GET http://admin/metrics (0 if absent)."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ten_thousand_messages_round_trip(broker_uri, queue_uri):
    # 10,000 distinct payloads of 200-2000 bytes: every post is ACKed SUCCESS, every payload
    # is received (and confirmed) at least once, nothing foreign arrives; duplicates are
    # counted and reported, not failed.
    count = 10_000
    producer_id = uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF
    payloads = [bmqpayload.encode(producer_id, i, 200 + (i * 7919) % 1801) for i in range(count)]
    inbox, acks = Inbox(), Acks()
    inbox.expect(payloads)
    consumer = start_session(broker_uri, inbox.on_message)
    try:
        consumer.open_queue(queue_uri, read=True)
        producer = start_session(broker_uri)
        try:
            producer.open_queue(queue_uri, write=True)
            post_all(producer, queue_uri, payloads, acks)
            producer.close_queue(queue_uri)
        finally:
            producer.stop()
        complete = inbox.wait_all()
        messages, counts = inbox.snapshot()
        sent = set(payloads)
        missing = sent - set(counts)
        foreign = [p for p in counts if p not in sent]
        duplicates = sum(n - 1 for p, n in counts.items() if p in sent)
        print(f"received {len(messages)} deliveries: {len(counts)} distinct, "
              f"{duplicates} duplicates, {len(foreign)} foreign")
        assert complete and not missing, (
            f"{len(missing)} of {count} payloads not received within {WAIT:.0f} s, e.g. "
            f"sequences {sorted(bmqpayload.verify(p)[1] for p in missing)[:10]}"
        )
        assert not foreign, f"{len(foreign)} payloads that were never sent, e.g. {foreign[:3]!r}"
        consumer.close_queue(queue_uri)
    finally:
        consumer.stop()


def test_sdk_producer_to_bmqctl_consumer(broker_uri, queue_uri, bmqctl):
    # 1,000 self-checking payloads (producer 7, sequences 0..999) posted by the SDK are all
    # received, verified and confirmed by `bmqctl consume` through our own protocol.
    count, producer_id = 1000, 7
    payloads = [bmqpayload.encode(producer_id, i, 512) for i in range(count)]
    acks = Acks()
    session = start_session(broker_uri)
    try:
        session.open_queue(queue_uri, write=True)
        post_all(session, queue_uri, payloads, acks)
        session.close_queue(queue_uri)
    finally:
        session.stop()

    proc, report = run_bmqctl(
        [bmqctl, "consume", "--queue", queue_uri, "--count", str(count), "--json",
         "--timeout-secs", "60"],
        timeout=WAIT + 30,
    )
    assert proc.returncode == 0, describe(proc)
    assert report is not None, f"no JSON report\n{describe(proc)}"
    assert report["distinct"] == count, f"distinct != {count}: {json.dumps(report, indent=2)}"
    assert report["corrupt"] == 0, f"corrupt payloads: {json.dumps(report, indent=2)}"
    producer = report["producers"].get(str(producer_id))
    assert producer == {"distinct": count, "max_sequence": count - 1}, (
        f"producer {producer_id} not complete: {json.dumps(report, indent=2)}"
    )


def test_bmqctl_producer_to_sdk_consumer(broker_uri, queue_uri, bmqctl):
    # 1,000 payloads of 256 bytes published by `bmqctl produce` are received by the SDK,
    # each one verifies with its producer id and sequence, and all are confirmed.
    count, size = 1000, 256
    proc, report = run_bmqctl(
        [bmqctl, "produce", "--queue", queue_uri, "--count", str(count), "--size", str(size),
         "--json"],
        timeout=WAIT + 30,
    )
    assert proc.returncode == 0, describe(proc)
    assert report is not None and report.get("acked") == count, (
        f"bmqctl produce did not get {count} ACKs\n{describe(proc)}"
    )
    producer_id = report["producer_id"]

    inbox = Inbox()
    session = start_session(broker_uri, inbox.on_message)
    try:
        session.open_queue(queue_uri, read=True)
        complete = inbox.wait_distinct(count)
        messages, counts = inbox.snapshot()
        assert complete, f"only {len(counts)} of {count} distinct messages within {WAIT:.0f} s"
        ids, errors = set(), []
        for data in counts:
            try:
                ids.add(bmqpayload.verify(data))
            except ValueError as e:
                errors.append(str(e))
        assert not errors, f"{len(errors)} payloads do not verify, e.g. {errors[:5]}"
        assert all(len(d) == size for d in counts), f"a payload is not {size} bytes"
        expected = {(producer_id, i) for i in range(count)}
        assert ids == expected, (
            f"ids differ: missing {sorted(expected - ids)[:10]}, foreign {sorted(ids - expected)[:10]}"
        )
        print(f"received {len(messages)} deliveries, {len(counts)} distinct")
        session.close_queue(queue_uri)
    finally:
        session.stop()


def test_unconfirmed_message_is_redelivered(broker_uri, queue_uri):
    # A consumer that stops its session without confirming leaves the message in the queue:
    # the next consumer receives the same payload.
    payload = b"redeliver me " + uuid.uuid4().hex.encode()
    acks = Acks()
    producer = start_session(broker_uri)
    try:
        producer.open_queue(queue_uri, write=True)
        post_all(producer, queue_uri, [payload], acks)
        producer.close_queue(queue_uri)
    finally:
        producer.stop()

    first = Inbox(confirm=False)
    session = start_session(broker_uri, first.on_message)
    try:
        session.open_queue(queue_uri, read=True)
        assert first.wait_distinct(1), f"the message was not delivered within {WAIT:.0f} s"
        assert first.messages[0].data == payload, f"first delivery {first.messages[0].data!r}"
    finally:
        session.stop()  # no confirm, no close: the broker sees the consumer go away

    second = Inbox()
    session = start_session(broker_uri, second.on_message)
    try:
        session.open_queue(queue_uri, read=True)
        assert second.wait_distinct(1), (
            f"the unconfirmed message was not redelivered within {WAIT:.0f} s"
        )
        assert second.messages[0].data == payload, f"redelivered {second.messages[0].data!r}"
        session.close_queue(queue_uri)
    finally:
        session.stop()


def test_unknown_domain_is_refused(broker_uri, queue_uri):
    # Opening a queue of a domain the cluster does not know raises a blazingmq error, and the
    # session still works for a valid queue afterwards.
    unknown = f"bmq://sdk-unknown-{uuid.uuid4().hex[:12]}.example/q"
    acks = Acks()
    session = start_session(broker_uri)
    try:
        with pytest.raises(blazingmq.Error) as refused:
            session.open_queue(unknown, write=True)
        print(f"open of {unknown} refused: {refused.value}")
        session.open_queue(queue_uri, write=True)
        post_all(session, queue_uri, [b"after a refused open"], acks)
        session.close_queue(queue_uri)
    finally:
        session.stop()


# --------------------------------------------------------------------------------------------
# Destructive: kills a node. Run alone (`pytest -m destructive`) on a cluster of its own.


def node_status(admin, timeout=2.0):
    """GET http://admin/status as a dict, or None if the node does not answer."""
    try:
        with urllib.request.urlopen(f"http://{admin}/status", timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def find_primary(nodes, uri, timeout=30.0):
    """(primary node id, partition id) of `uri`, polling every node's /status until known."""
    deadline = time.monotonic() + timeout
    docs = []
    while time.monotonic() < deadline:
        docs = [node_status(n.admin) for n in nodes]
        for doc in filter(None, docs):
            queue = next((q for q in doc.get("queues", []) if q["uri"] == uri), None)
            if queue is None:
                continue
            part = next(
                (p for p in doc.get("partitions", [])
                 if p["partition_id"] == queue["partition_id"]),
                None,
            )
            if part is not None and part.get("primary") is not None:
                return part["primary"], queue["partition_id"]
        time.sleep(0.2)
    raise AssertionError(
        f"{uri} has no assigned primary on any node after {timeout:.0f} s: "
        f"{json.dumps(docs)[:4000]}"
    )


@pytest.mark.destructive
def test_primary_sigkill_while_producing(sdk_brokers, queue_uri, nodes):
    # The SDK produces 3,000 messages through a node that is not the queue's primary; the
    # primary is SIGKILLed after ~1,000 posts. Every post must get an ACK, and every message
    # ACKed SUCCESS must then be consumed (no acknowledged message lost). Non-SUCCESS ACKs are
    # allowed and reported.
    assert len(nodes) >= 2 and len(sdk_brokers) >= len(nodes), (
        f"needs every node's bmqp listener: nodes {nodes}, BMQ_SDK_BROKERS {sdk_brokers}"
    )
    count, kill_after, rate = 3000, 1000, 500.0  # posts, posts before the kill, posts/s

    # Open as writer on node 1 so the queue gets assigned, then find its primary.
    session = start_session(sdk_brokers[0])
    try:
        session.open_queue(queue_uri, write=True)
        primary, partition = find_primary(nodes, queue_uri)
        session.close_queue(queue_uri)
    finally:
        session.stop()
    victim = next(n for n in nodes if n.id == primary)
    survivor = next(n for n in nodes if n.id != primary)
    broker = sdk_brokers[survivor.id - 1]
    print(f"{queue_uri}: partition {partition}, primary node {primary} (pid {victim.pid}); "
          f"producing through node {survivor.id} at {broker}")

    producer_id = uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF
    payloads = [bmqpayload.encode(producer_id, i, 512) for i in range(count)]
    acks = Acks()
    post_errors = {}
    producer = start_session(broker)
    try:
        producer.open_queue(queue_uri, write=True)
        start = time.monotonic()
        for i, payload in enumerate(payloads):
            if i == kill_after:
                os.kill(victim.pid, signal.SIGKILL)
                print(f"SIGKILL node {victim.id} after {i} posts")
            try:
                producer.post(queue_uri, payload, on_ack=acks.callback(i))
            except blazingmq.Error as e:
                post_errors[i] = str(e)
            # Paced, so the kill lands while messages are in flight.
            time.sleep(max(0.0, start + (i + 1) / rate - time.monotonic()))
        posted = count - len(post_errors)
        all_acked = acks.wait(posted)
        try:
            producer.close_queue(queue_uri)
        except blazingmq.Error as e:
            print(f"closing the producer's queue failed: {e}")
    finally:
        producer.stop()

    failures = acks.failures()
    reasons = collections.Counter(acks.status[k].name for k in failures)
    print(f"posted {posted} (post errors {len(post_errors)}), ACKs {len(acks.status)}, "
          f"non-SUCCESS {len(failures)}: {dict(reasons)}")
    if post_errors:
        print(f"post errors, e.g. {list(post_errors.items())[:5]}")
    assert all_acked, (
        f"only {len(acks.status)} of {posted} posts were ACKed within {WAIT:.0f} s"
    )
    acked = [payloads[i] for i, s in acks.status.items() if s == SUCCESS]

    inbox = Inbox()
    inbox.expect(acked)
    consumer = start_session(broker, inbox.on_message)
    try:
        consumer.open_queue(queue_uri, read=True)
        complete = inbox.wait_all()
        messages, counts = inbox.snapshot()
        with inbox.cond:
            missing = sorted(bmqpayload.verify(p)[1] for p in inbox.missing)
        print(f"consumed {len(messages)} deliveries, {len(counts)} distinct "
              f"(ACKed SUCCESS: {len(acked)})")
        assert complete and not missing, (
            f"{len(missing)} of {len(acked)} messages ACKed SUCCESS were not consumed within "
            f"{WAIT:.0f} s, e.g. sequences {missing[:20]}"
        )
        consumer.close_queue(queue_uri)
    finally:
        consumer.stop()


def test_fanout_apps_each_get_every_message(broker_uri, fanout_domain):
    # Readers of two apps of a fanout queue (uri?id=foo, uri?id=bar) each receive every
    # message once and confirm it for their app only; a confirmed app gets nothing again.
    uri = f"bmq://{fanout_domain}/sdk-fanout-{uuid.uuid4().hex[:12]}"
    payloads = [f"fanout {i}".encode() for i in range(20)]
    inboxes = {app: Inbox() for app in ("foo", "bar")}
    readers = {}
    try:
        for app, inbox in inboxes.items():
            readers[app] = start_session(broker_uri, inbox.on_message)
            readers[app].open_queue(f"{uri}?id={app}", read=True)
            inbox.expect(payloads)
        producer = start_session(broker_uri)
        try:
            producer.open_queue(uri, write=True)
            post_all(producer, uri, payloads, Acks())
        finally:
            producer.stop()
        for app, inbox in inboxes.items():
            assert inbox.wait_all(), f"app {app}: missing {sorted(inbox.missing)[:5]}"
            messages, counts = inbox.snapshot()
            assert set(counts) == set(payloads), f"app {app} got foreign messages"
            assert all(m.queue_uri == f"{uri}?id={app}" for m in messages), (
                f"app {app}: delivered for {messages[0].queue_uri!r}"
            )
    finally:
        for session in readers.values():
            session.stop()
    again = Inbox()
    session = start_session(broker_uri, again.on_message)
    try:
        session.open_queue(f"{uri}?id=foo", read=True)
        assert not again.wait_distinct(1, timeout=2.0), (
            f"app foo got confirmed messages again: {again.messages[:3]}"
        )
    finally:
        session.stop()


def test_readme_example_runs(broker_uri):
    # The README's example (docs/examples/hello_sdk.py) as a user runs it, with the broker
    # given the way the SDK reads it from the environment.
    example = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "examples", "hello_sdk.py")
    env = dict(os.environ, BMQ_BROKER_URI=broker_uri)
    proc = subprocess.run(
        [sys.executable, example], env=env, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-2000:]}"
    assert "ack AckStatus.SUCCESS" in out, out
    assert "received b'hello from the SDK' {'kind': 'greeting'}" in out, out
