# BlazingMQ's official Python SDK (pip install blazingmq==1.2.2) against `bmqctl cluster up`:
# the SDK's default broker, tcp://localhost:30114, is node 1's bmqp port. README.md,
# "Applications on BlazingMQ's SDKs"; run by tests/sdk/test_sdk.py.
import threading, blazingmq

URI = "bmq://bmq.test/hello-sdk"
got = threading.Event()

def on_message(msg, handle):
    print("received", msg.data, msg.properties)
    handle.confirm()
    got.set()

with blazingmq.Session(blazingmq.session_events.log_session_event, on_message=on_message) as session:
    session.open_queue(URI, read=True, write=True)
    session.post(URI, b"hello from the SDK", properties={"kind": "greeting"},
                 on_ack=lambda ack: print("ack", ack.status))
    got.wait(10)
    session.close_queue(URI)
