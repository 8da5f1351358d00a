"""Throughput and ACK latency of the bmqp listener with the official BlazingMQ Python SDK.

A benchmark, not a test:

    python tests/sdk/bench_sdk.py --broker tcp://127.0.0.1:PORT --uri bmq://bmq.test/bench-sdk \\
        --count 20000 --size 1024 [--window 1000] [--timeout 120]

A consumer session opens the queue for reading and confirms everything it receives; a producer
session on the same broker posts `count` messages of `size` bytes with on_ack, keeping at most
`window` of them un-ACKed (a semaphore released by each ACK), and records each message's ACK
latency (post -> on_ack). The clock runs from the first post until every message is both
ACKed and received. Prints one JSON line on standard output:

    {"count", "size", "seconds", "msgs_per_sec", "ack_p50_ms", "ack_p99_ms", "received",
     "nacked"}

`received` counts the distinct messages of this run delivered to the consumer (leftovers of
earlier runs on the same queue are confirmed but not counted); `nacked` the ACKs that are not
SUCCESS. Exits 1 if a message was NACKed, not ACKed or not received before the timeout.

Environment: none required. BMQ_BROKER_URI is the default of --broker; it is removed from the
environment because the SDK would otherwise let it override --broker.
"""

import argparse
import json
import os
import struct
import sys
import threading
import time
import uuid

import blazingmq

DEFAULT_BROKER = os.environ.pop("BMQ_BROKER_URI", None) or "tcp://localhost:30114"


def percentile_ms(sorted_secs, q):
    """Nearest-rank percentile of sorted latencies (seconds), in milliseconds."""
    if not sorted_secs:
        return None
    i = min(len(sorted_secs) - 1, max(0, round(q * len(sorted_secs)) - 1))
    return round(sorted_secs[i] * 1000.0, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--broker", default=DEFAULT_BROKER, help="tcp://host:port of a bmqp listener")
    ap.add_argument("--uri", required=True, help="queue, bmq://<domain>/<name>")
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--size", type=int, default=1024, help="payload bytes (at least 16)")
    ap.add_argument("--window", type=int, default=1000, help="most un-ACKed posts at once")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole run")
    args = ap.parse_args()
    if args.count < 1 or args.window < 1:
        ap.error("--count and --window must be at least 1")

    run_id = uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF
    size = max(args.size, 16)
    pad = b"\xa5" * (size - 16)
    payloads = [struct.pack(">QQ", run_id, i) + pad for i in range(args.count)]

    lock = threading.Lock()
    window = threading.Semaphore(args.window)
    all_acked = threading.Event()
    all_received = threading.Event()
    posted_at = [0.0] * args.count
    latency = []  # seconds, one per ACK
    nacked = [0]
    received = set()

    def make_on_ack(i):
        def on_ack(ack):
            now = time.monotonic()
            with lock:
                latency.append(now - posted_at[i])
                if ack.status != blazingmq.AckStatus.SUCCESS:
                    nacked[0] += 1
                if len(latency) == args.count:
                    all_acked.set()
            window.release()

        return on_ack

    def on_message(msg, handle):
        handle.confirm()
        if len(msg.data) >= 16:
            rid, seq = struct.unpack(">QQ", msg.data[:16])
            if rid == run_id:
                with lock:
                    received.add(seq)
                    if len(received) == args.count:
                        all_received.set()

    timeouts = blazingmq.Timeouts(
        connect_timeout=30.0,
        disconnect_timeout=30.0,
        open_queue_timeout=30.0,
        configure_queue_timeout=30.0,
        close_queue_timeout=30.0,
    )
    log = blazingmq.session_events.log_session_event
    consumer = producer = None
    try:
        consumer = blazingmq.Session(log, on_message=on_message, broker=args.broker,
                                     timeout=timeouts)
        consumer.open_queue(args.uri, read=True)
        producer = blazingmq.Session(log, broker=args.broker, timeout=timeouts)
        producer.open_queue(args.uri, write=True)

        start = time.monotonic()
        deadline = start + args.timeout
        for i, payload in enumerate(payloads):
            if not window.acquire(timeout=max(0.0, deadline - time.monotonic())):
                print(f"bench_sdk: window never freed; stopped after {i} posts",
                      file=sys.stderr)
                break
            posted_at[i] = time.monotonic()
            producer.post(args.uri, payload, on_ack=make_on_ack(i))
        all_acked.wait(max(0.0, deadline - time.monotonic()))
        all_received.wait(max(0.0, deadline - time.monotonic()))
        seconds = time.monotonic() - start

        producer.close_queue(args.uri)
        consumer.close_queue(args.uri)
    finally:
        for session in (producer, consumer):
            if session is not None:
                session.stop()

    with lock:
        lat = sorted(latency)
        result = {
            "count": args.count,
            "size": size,
            "seconds": round(seconds, 3),
            "msgs_per_sec": round(args.count / seconds, 1) if seconds > 0 else None,
            "ack_p50_ms": percentile_ms(lat, 0.50),
            "ack_p99_ms": percentile_ms(lat, 0.99),
            "received": len(received),
            "nacked": nacked[0],
        }
        ok = len(lat) == args.count and nacked[0] == 0 and len(received) == args.count
    print(json.dumps(result), flush=True)
    if not ok:
        print(f"bench_sdk: incomplete run: {len(lat)} ACKs ({nacked[0]} not SUCCESS), "
              f"{len(received)} received, of {args.count}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
