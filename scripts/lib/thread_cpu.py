"""Per-thread CPU time and context switches of processes, from /proc (scripts/bench-threads.sh).

  thread_cpu.py snap OUT.json PID...     record every thread's utime+stime and switch counts
  thread_cpu.py diff A.json B.json OPS   print, per thread, CPU us and switches per operation
"""
import json
import os
import sys


def snap(pids):
    out = {}
    for p in pids:
        threads = {}
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                stat = open(f"/proc/{p}/task/{t}/stat").read()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2 :].split()
                cpu = int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
                vol = nonvol = 0
                for line in open(f"/proc/{p}/task/{t}/status"):
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        nonvol = int(line.split()[1])
                threads[t] = (name, cpu, vol, nonvol)
            except FileNotFoundError:
                pass  # the thread ended meanwhile
        out[p] = threads
    return out


def diff(a, b, ops):
    hz = os.sysconf("SC_CLK_TCK")
    total = 0.0
    total_switches = 0.0
    for p in b:
        for t, (name, cpu, vol, nonvol) in sorted(b[p].items(), key=lambda kv: int(kv[0])):
            if t not in a.get(p, {}):
                continue
            _, cpu0, vol0, nonvol0 = a[p][t]
            us = (cpu - cpu0) / hz * 1e6 / ops
            total += us
            switches = (vol - vol0 + nonvol - nonvol0) / ops
            total_switches += switches
            if us > 0.05 or switches > 0.01:
                main = " (main)" if t == p else ""
                print(f"pid {p} tid {t} {name + main:24s} CPU {us:7.2f} us/op  "
                      f"switches {switches:6.3f}/op (voluntary {(vol - vol0) / ops:.3f})")
    print(f"all broker threads: CPU {total:.2f} us/op (clock tick {1e6 / hz:.0f} us), "
          f"switches {total_switches:.3f}/op")


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        json.dump(snap(sys.argv[3:]), open(sys.argv[2], "w"))
    else:
        diff(json.load(open(sys.argv[2])), json.load(open(sys.argv[3])), float(sys.argv[4]))
