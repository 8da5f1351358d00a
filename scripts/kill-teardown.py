#!/usr/bin/env python3
"""How long after SIGKILL a process's TCP peer sees the connection close, by the RSS of the
killed process: Linux frees the memory of an exiting process before it closes its files, so
a SIGKILLed broker's peers learn of its death later the larger it is (docs/bench/JOURNAL.md,
"Failover flat in the state"). Run: python3 scripts/kill-teardown.py"""
import os, signal, socket, time, sys
for mib in (1, 100, 300, 600, 1200):
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    port = srv.getsockname()[1]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        buf = bytearray(mib * 1024 * 1024)
        for i in range(0, len(buf), 4096): buf[i] = 1
        c = socket.create_connection(("127.0.0.1", port))
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    conn, _ = srv.accept(); os.read(r, 1)
    t0 = time.monotonic(); os.kill(pid, signal.SIGKILL)
    conn.recv(1)
    dt = (time.monotonic() - t0) * 1000
    os.waitpid(pid, 0)
    print(f"RSS {mib} MiB: SIGKILL -> peer sees the close after {dt:.1f} ms")
