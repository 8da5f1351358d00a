#!/usr/bin/env python3
"""Writes the Grafana dashboards of dashboards/grafana/*.json.

The JSON files are what Grafana loads and what tests/tests/prometheus.rs evaluates; this script
is how they are written, so that every panel follows the same conventions:

- every query selects `job="bmq"` and `node=~"$node"` (the `node` label comes from the scrape
  configuration, one per target; Prometheus adds `instance`);
- rates use `[$__rate_interval]` (Grafana: max(4 x scrape interval, interval + scrape interval));
- every histogram panel computes quantiles from the `_bucket` series (the broker exports real
  histograms with explicit buckets).

Run `python3 dashboards/generate.py` after editing, then `cargo test -p bmq-tests --test
prometheus` to prove every panel still returns data.
"""

import json
import os

DS = {"type": "prometheus", "uid": "bmq-prometheus"}
SEL = 'job="bmq", node=~"$node"'
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana")


def target(expr, legend, ref):
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


class Dash:
    def __init__(self, uid, title, description):
        self.uid, self.title, self.description = uid, title, description
        self.panels = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title):
        self.newline()
        self.panels.append({
            "type": "row", "title": title, "id": self.next_id, "collapsed": False,
            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": [],
        })
        self.next_id += 1
        self.y += 1

    def newline(self):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def panel(self, title, description, targets, unit="short", kind="timeseries", w=8, h=8,
              mappings=None, decimals=None, stack=False):
        if self.x + w > 24:
            self.newline()
        refs = "ABCDEFGH"
        panel = {
            "type": kind,
            "title": title,
            "description": description,
            "id": self.next_id,
            "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "targets": [target(e, l, refs[i]) for i, (e, l) in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {},
        }
        if decimals is not None:
            panel["fieldConfig"]["defaults"]["decimals"] = decimals
        if mappings:
            panel["fieldConfig"]["defaults"]["mappings"] = [{
                "type": "value",
                "options": {str(k): {"text": v, "index": i} for i, (k, v) in enumerate(mappings)},
            }]
        if kind == "timeseries":
            panel["fieldConfig"]["defaults"]["custom"] = {
                "drawStyle": "line", "lineInterpolation": "stepAfter", "fillOpacity": 10,
                "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            }
            panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                                "tooltip": {"mode": "multi", "sort": "desc"}}
        if kind == "stat":
            panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                  "values": False},
                                "colorMode": "value", "graphMode": "none"}
        self.panels.append(panel)
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)

    def write(self):
        doc = {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["bmq"],
            "timezone": "browser",
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "refresh": "5s",
            "time": {"from": "now-15m", "to": "now"},
            "templating": {"list": [{
                "name": "node",
                "label": "node",
                "type": "query",
                "datasource": DS,
                "query": {"query": 'label_values(up{job="bmq"}, node)', "refId": "node"},
                "definition": 'label_values(up{job="bmq"}, node)',
                "refresh": 2,
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "sort": 3,
            }]},
            "annotations": {"list": []},
            "links": [{"title": "bmq dashboards", "type": "dashboards", "tags": ["bmq"],
                       "asDropdown": True}],
            "panels": self.panels,
        }
        path = os.path.join(OUT, self.uid + ".json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print("wrote", path)


def rate(metric, by, extra=""):
    sel = SEL + extra
    return f"sum by ({by}) (rate({metric}{{{sel}}}[$__rate_interval]))"


def quantiles(metric, qs=(0.5, 0.9, 0.99)):
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}"
             f"[$__rate_interval])))", f"p{q * 100:g}") for q in qs]


ELECTOR_STATES = [(0, "dormant"), (1, "follower"), (2, "candidate"), (3, "leader")]
PRIMARY_STATUS = [(0, "none"), (1, "passive"), (2, "active")]
METADATA_ROLES = [(0, "follower"), (1, "passive leader"), (2, "active leader")]
LEADER_VIEW = 'and on(instance) (bmq_elector_state{job="bmq"} == 3)'


def cluster():
    d = Dash("bmq-cluster", "bmq / Cluster overview",
             "Leader election, the metadata ledger, node health and the partition table.")
    d.row("Leadership")
    d.panel("Leader (as seen by each node)",
            "bmq_elector_leader_node_id: the node each node follows (0 = no leader).",
            [(f"bmq_elector_leader_node_id{{{SEL}}}", "seen by {{node}}")], decimals=0)
    d.panel("Term", "bmq_elector_term per node. A term only grows; a step is an election.",
            [(f"bmq_elector_term{{{SEL}}}", "{{node}}")], decimals=0)
    d.panel("Elector state", "bmq_elector_state per node.",
            [(f"bmq_elector_state{{{SEL}}}", "{{node}}")], mappings=ELECTOR_STATES)
    d.panel("Elections",
            "ElectionScouting rounds, elections started and won per rate interval.",
            [(f"sum(increase(bmq_elector_scoutings_started_total{{{SEL}}}[$__rate_interval]))",
              "scoutings started"),
             (f"sum(increase(bmq_elector_elections_started_total{{{SEL}}}[$__rate_interval]))",
              "elections started"),
             (f"sum(increase(bmq_elector_elections_won_total{{{SEL}}}[$__rate_interval]))",
              "elections won")])
    d.panel("Elector transitions by reason",
            "bmq_elector_transitions_total: state changes per rate interval by TransitionReason.",
            [(f"sum by (reason) (increase(bmq_elector_transitions_total{{{SEL}}}"
              "[$__rate_interval]))", "{{reason}}")])
    d.panel("Leader heartbeats missed",
            "bmq_elector_heartbeats_missed_total per node, per rate interval.",
            [(f"sum by (node) (increase(bmq_elector_heartbeats_missed_total{{{SEL}}}"
              "[$__rate_interval]))", "{{node}}")])
    d.row("Metadata ledger")
    d.panel("Last and committed LSN (sequence)",
            "bmq_metadata_lsn_sequence and bmq_metadata_committed_lsn_sequence; the LSN is "
            "(term, sequence) and the sequence restarts at each term.",
            [(f"bmq_metadata_lsn_sequence{{{SEL}}}", "last {{node}}"),
             (f"bmq_metadata_committed_lsn_sequence{{{SEL}}}", "committed {{node}}")],
            decimals=0)
    d.panel("LSN term", "bmq_metadata_lsn_term and bmq_metadata_committed_lsn_term per node.",
            [(f"bmq_metadata_lsn_term{{{SEL}}}", "last {{node}}"),
             (f"bmq_metadata_committed_lsn_term{{{SEL}}}", "committed {{node}}")], decimals=0)
    d.panel("Uncommitted advisories",
            "bmq_metadata_uncommitted_advisories: advisories held but not yet committed.",
            [(f"bmq_metadata_uncommitted_advisories{{{SEL}}}", "{{node}}")], decimals=0)
    d.panel("Commit latency (leader)",
            "bmq_metadata_commit_latency_seconds: propose to quorum commit, on the leader.",
            quantiles("bmq_metadata_commit_latency_seconds"), unit="s")
    d.panel("Metadata role", "bmq_metadata_role per node.",
            [(f"bmq_metadata_role{{{SEL}}}", "{{node}}")], mappings=METADATA_ROLES)
    d.panel("Ledger size", "bmq_metadata_ledger_bytes: size of the current ledger file.",
            [(f"bmq_metadata_ledger_bytes{{{SEL}}}", "{{node}}")], unit="bytes")
    d.row("Node health")
    d.panel("Nodes up", "Prometheus `up`: 1 when the node's /metrics answered the last scrape.",
            [(f"up{{{SEL}}}", "{{node}}")], mappings=[(0, "down"), (1, "up")])
    d.panel("Peer availability",
            "bmq_peer_available: each node's view of each peer (control link up and fresh).",
            [(f"bmq_peer_available{{{SEL}}}", "{{node}} sees {{peer}}")])
    d.panel("Available members (per node's view)",
            "This node plus its available peers, against the elector quorum.",
            [(f"1 + sum by (node) (bmq_peer_available{{{SEL}}})", "{{node}}"),
             (f"max(bmq_elector_quorum{{{SEL}}})", "quorum")], decimals=0)
    d.row("Partitions (the leader's committed view)")
    d.panel("Primary per partition",
            "bmq_cluster_partition_primary_node_id as the leader sees it (0 = none).",
            [(f"max by (partition) (bmq_cluster_partition_primary_node_id{{{SEL}}} "
              f"{LEADER_VIEW})", "partition {{partition}}")], decimals=0)
    d.panel("Primary lease per partition",
            "bmq_cluster_partition_primary_lease_id as the leader sees it; +1 at each change "
            "of primary.",
            [(f"max by (partition) (bmq_cluster_partition_primary_lease_id{{{SEL}}} "
              f"{LEADER_VIEW})", "partition {{partition}}")], decimals=0)
    d.panel("Primary status per partition",
            "bmq_cluster_partition_status as the leader sees it.",
            [(f"max by (partition) (bmq_cluster_partition_status{{{SEL}}} {LEADER_VIEW})",
              "partition {{partition}}")], mappings=PRIMARY_STATUS)
    d.panel("Partitions with a reachable active primary",
            "bmq_cluster_partition_primary_reachable, best over nodes: 0 means no node can "
            "reach an active primary for the partition (alert BmqPartitionWithoutActivePrimary).",
            [(f"max by (partition) (bmq_cluster_partition_primary_reachable{{{SEL}}})",
              "partition {{partition}}")], mappings=[(0, "no"), (1, "yes")])
    d.panel("Partition table",
            "Primary, lease and status per partition, leader's view, now.",
            [(f"max by (partition) (bmq_cluster_partition_primary_node_id{{{SEL}}} "
              f"{LEADER_VIEW})", "primary"),
             (f"max by (partition) (bmq_cluster_partition_primary_lease_id{{{SEL}}} "
              f"{LEADER_VIEW})", "lease"),
             (f"max by (partition) (bmq_cluster_partition_status{{{SEL}}} {LEADER_VIEW})",
              "status")], kind="stat", w=8)
    d.panel("Queues assigned", "bmq_cluster_queues: queues in the committed state.",
            [(f"max(bmq_cluster_queues{{{SEL}}})", "queues")], kind="stat", decimals=0)
    d.write()


def queues():
    d = Dash("bmq-queues", "bmq / Queues",
             "Message traffic through the queues, depth, unconfirmed messages, latency, NACKs.")
    d.row("Rates (messages per second, by node that counted them)")
    d.panel("PUT rate", "bmq_queue_put_total: PUTs received by a partition's primary.",
            [(rate("bmq_queue_put_total", "node"), "{{node}}")], unit="ops", stack=True, w=6)
    d.panel("ACK rate", "bmq_queue_ack_total: successful ACKs sent by a primary.",
            [(rate("bmq_queue_ack_total", "node"), "{{node}}")], unit="ops", stack=True, w=6)
    d.panel("PUSH rate", "bmq_queue_push_total: messages pushed to consumers by a primary.",
            [(rate("bmq_queue_push_total", "node"), "{{node}}")], unit="ops", stack=True, w=6)
    d.panel("CONFIRM rate", "bmq_queue_confirm_total: confirms applied by a primary.",
            [(rate("bmq_queue_confirm_total", "node"), "{{node}}")], unit="ops", stack=True,
            w=6)
    d.row("Backlog")
    d.panel("Depth per partition",
            "bmq_partition_messages: messages held and not yet confirmed, summed over the "
            "partition's primary (other nodes report 0).",
            [(f"sum by (partition) (bmq_partition_messages{{{SEL}}})",
              "partition {{partition}}")], stack=True)
    d.panel("Unconfirmed per partition",
            "bmq_partition_unconfirmed_messages: pushed to a consumer, not yet confirmed.",
            [(f"sum by (partition) (bmq_partition_unconfirmed_messages{{{SEL}}})",
              "partition {{partition}}")], stack=True)
    d.panel("Active queues per partition",
            "bmq_partition_queues on each partition's primary: queues with a consumer attached "
            "or a message held.",
            [(f"sum by (partition) (bmq_partition_queues{{{SEL}}})",
              "partition {{partition}}")], decimals=0)
    d.row("Latency and failures")
    d.panel("ACK latency",
            "bmq_queue_ack_latency_seconds: from a PUT received from the client to its ACK "
            "sent back, on the node the producer is connected to.",
            quantiles("bmq_queue_ack_latency_seconds"), unit="s")
    d.panel("Journal fsync latency",
            "bmq_journal_fsync_seconds: each group-commit fsync of a partition journal, on its "
            "sync thread. Receipts and ACKs wait for it: a slow disk shows here first.",
            quantiles("bmq_journal_fsync_seconds"), unit="s")
    d.panel("Partition thread turns",
            "bmq_partition_turn_seconds: how long a partition's thread spent on one input (a "
            "batch of requests or peer messages, a timer, a sync's completion), maintenance "
            "included. Every ACK and delivery of the partition waits behind a long turn: a "
            "stall shows as a high p99.9 (alert BmqPartitionThreadStalls).",
            quantiles("bmq_partition_turn_seconds", qs=(0.5, 0.99, 0.999)), unit="s")
    d.panel("Journal space reclaimed",
            "Segments closed (bmq_journal_rollovers_total), deleted because every record in "
            "them was dead and settled (bmq_journal_segments_deleted_total), and compacted: "
            "rewritten with their live records on the partition's compaction thread "
            "(bmq_journal_compactions_total; each copy's duration is "
            "bmq_journal_compaction_seconds). Deletions and compactions keep pace with "
            "rollovers while consumers keep up.",
            [(rate("bmq_journal_rollovers_total", "node"), "closed {{node}}"),
             (rate("bmq_journal_segments_deleted_total", "node"), "deleted {{node}}"),
             (rate("bmq_journal_compactions_total", "node"), "compacted {{node}}")],
            unit="ops")
    d.panel("Redeliveries",
            "bmq_queue_redeliveries_total: pushes with delivery attempt > 1 (a consumer failed "
            "this message before).",
            [(rate("bmq_queue_redeliveries_total", "node"), "{{node}}")], unit="ops")
    d.panel("Consumer failures",
            "bmq_queue_consumer_failures_total: a consumer went away (or closed the queue) "
            "holding a message, one per message. Primary moves and graceful stops do not count.",
            [(rate("bmq_queue_consumer_failures_total", "node"), "{{node}}")], unit="ops")
    d.panel("Removed without a confirm",
            "bmq_queue_removed_total: messages dropped unconfirmed, by reason: ttl, "
            "attempts_exhausted (poison), purged. Each is logged at warn with queue and GUID; "
            "alert BmqMessagesRemovedWithoutConfirm.",
            [(f"sum by (reason) (increase(bmq_queue_removed_total{{{SEL}}}[$__rate_interval]))",
              "{{reason}}")], decimals=0)
    d.panel("NACKs by reason",
            "bmq_queue_nack_total: PUTs answered with a failure status, by reason.",
            [(rate("bmq_queue_nack_total", "reason"), "{{reason}}")], unit="ops")
    d.write()


def node():
    d = Dash("bmq-node", "bmq / Node",
             "Per-node resources: connections, CPU, memory, actor mailboxes, rejected input.")
    d.row("Connections")
    d.panel("Client sessions", "bmq_client_sessions: client connections past Hello.",
            [(f"bmq_client_sessions{{{SEL}}}", "{{node}}")], decimals=0)
    d.panel("Client connections accepted",
            "bmq_client_connections_total per second.",
            [(rate("bmq_client_connections_total", "node"), "{{node}}")], unit="ops")
    d.panel("Peer connections (control)",
            "bmq_peer_connections: control-channel connections by direction.",
            [(f"bmq_peer_connections{{{SEL}}}", "{{node}} {{direction}}")], decimals=0)
    d.row("Resources")
    d.panel("CPU", "rate(process_cpu_seconds_total): cores used by the broker process.",
            [(rate("process_cpu_seconds_total", "node"), "{{node}}")], unit="percentunit",
            w=12)
    d.panel("Resident memory", "process_resident_memory_bytes.",
            [(f"process_resident_memory_bytes{{{SEL}}}", "{{node}}")], unit="bytes", w=12)
    d.panel("Main thread lag",
            "bmq_main_thread_lag_seconds: how much later than asked a 10 ms timer fires on the "
            "main thread, which carries every client session and peer link. Up to ~1 ms is "
            "the timer's resolution; a high p99.9 is a stall every client and peer waits "
            "behind (the partitions' threads: Partition thread turns on the Queues dashboard).",
            quantiles("bmq_main_thread_lag_seconds", qs=(0.5, 0.99, 0.999)), unit="s", w=24)
    d.row("Mailboxes and rejected input")
    d.panel("Mailbox delay",
            "bmq_actor_mailbox_delay_seconds: round trip of a status request through each "
            "actor's mailbox at scrape time. It grows with the mailbox backlog.",
            [(f"bmq_actor_mailbox_delay_seconds{{{SEL}}}", "{{node}} {{actor}}")], unit="s")
    d.panel("Rejected client input",
            "Client frames that failed to decode and protocol violations (per second).",
            [(rate("bmq_client_frame_errors_total", "node"), "bad frame {{node}}"),
             (rate("bmq_client_protocol_errors_total", "node"), "protocol {{node}}")],
            unit="ops")
    d.write()


if __name__ == "__main__":
    cluster()
    queues()
    node()
