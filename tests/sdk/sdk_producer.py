"""An SDK producer for tests/tests/sdk.rs: posts numbered messages at a steady pace and writes
what happened to each one as JSON, so the Rust test can kill and restart the node this
producer is connected to meanwhile and then check every ACKed message was delivered.

    python sdk_producer.py --broker tcp://127.0.0.1:PORT --uri bmq://bmq.test/q \\
        --count 2000 --rate 400 --out result.json

Payload of message i: b"sdk-producer <i>". The session is libbmq's: when its connection
drops it reconnects to the same broker, reopens the queue and resends the PUTs not ACKed yet
(with their GUIDs). Posting goes on through the outage; a post the SDK refuses is recorded and
not retried. Waits up to --ack-timeout seconds after the last post for the outstanding ACKs.
Writes {"acked": [i...], "nacked": {i: status}, "refused": {i: error}, "unacked": [i...],
"session_events": [...]} and exits 0 (the Rust test judges).
"""

import argparse
import json
import os
import threading
import time

import blazingmq

# The SDK lets BMQ_BROKER_URI override --broker: never read it here.
os.environ.pop("BMQ_BROKER_URI", None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--ack-timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    lock = threading.Condition()
    status = {}
    events = []

    def on_session_event(event):
        with lock:
            events.append(repr(event))

    def on_ack_for(i):
        def on_ack(ack):
            with lock:
                status[i] = ack.status
                lock.notify_all()

        return on_ack

    session = blazingmq.Session(
        on_session_event,
        broker=args.broker,
        timeout=blazingmq.Timeouts(
            connect_timeout=30.0,
            disconnect_timeout=30.0,
            open_queue_timeout=30.0,
            configure_queue_timeout=30.0,
            close_queue_timeout=30.0,
        ),
    )
    refused = {}
    try:
        session.open_queue(args.uri, write=True)
        start = time.monotonic()
        for i in range(args.count):
            delay = start + i / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                session.post(args.uri, f"sdk-producer {i}".encode(), on_ack=on_ack_for(i))
            except Exception as e:  # the SDK may refuse a post while it reconnects
                refused[i] = repr(e)
        posted = [i for i in range(args.count) if i not in refused]
        with lock:
            lock.wait_for(lambda: all(i in status for i in posted), args.ack_timeout)
            result = {
                "acked": sorted(i for i, s in status.items() if s == blazingmq.AckStatus.SUCCESS),
                "nacked": {i: repr(s) for i, s in status.items() if s != blazingmq.AckStatus.SUCCESS},
                "refused": refused,
                "unacked": [i for i in posted if i not in status],
                "session_events": list(events),
            }
    finally:
        session.stop()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
