#!/usr/bin/env python3
"""Writes the Grafana dashboards of dashboards/grafana/*.json and the same dashboards as
Prometheus console templates, dashboards/consoles/*.html.

The JSON files are what Grafana loads and what tests/tests/prometheus.rs evaluates; the console
pages are what the Prometheus of `bmqctl cluster up` and of the compose file serve at
/consoles/bmq-*.html (tests/tests/consoles.rs opens them in a browser). This script is how both
are written, from one list of panels, so that every panel follows the same conventions:

- every query selects `job="bmq"` and `node=~"$node"` (the `node` label comes from the scrape
  configuration, one per target; Prometheus adds `instance`);
- rates use `[$__rate_interval]` (Grafana: max(4 x scrape interval, interval + scrape interval));
- every histogram panel computes quantiles from the `_bucket` series (the broker exports real
  histograms with explicit buckets).

A console page has the panels and queries of its Grafana dashboard with the Grafana variables
replaced: `$__rate_interval` by a fixed `[15s]` (several 1 s scrapes per window, short enough for
a failover) and `$node` by the page's `node` URL parameter (a regular expression, all nodes when
absent: `bmq-queues.html?node=2`). Graphs are drawn by the console library's PromConsole.Graph,
single values (Grafana's stat panels) are queried when Prometheus renders the page.

Run `python3 dashboards/generate.py` after editing, then `cargo test -p bmq-tests --test
prometheus` to prove every panel still returns data. `--check` writes nothing and fails if a
committed file differs from what this script writes.
"""

import html
import json
import os
import re
import sys

DS = {"type": "prometheus", "uid": "bmq-prometheus"}
SEL = 'job="bmq", node=~"$node"'
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "grafana")
CONSOLES = os.path.join(HERE, "consoles")
# What a console page uses for Grafana's $__rate_interval (see the module doc).
CONSOLE_RATE_INTERVAL = "15s"
# Files that differ from what this script writes (--check).
STALE = []


def emit(path, text):
    """Writes `text` to `path`, or with --check records whether the file differs."""
    if "--check" in sys.argv[1:]:
        try:
            with open(path) as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            STALE.append(path)
        return
    with open(path, "w") as f:
        f.write(text)
    print("wrote", path)


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
        emit(os.path.join(OUT, self.uid + ".json"), json.dumps(doc, indent=2) + "\n")
        emit(os.path.join(CONSOLES, self.uid + ".html"), console_page(self))

# The console pages, in the order of their links, with a short name for the links.
CONSOLE_PAGES = [("bmq-cluster", "Cluster"), ("bmq-queues", "Queues"),
                 ("bmq-storage", "Storage"), ("bmq-node", "Node")]

# Grafana unit -> (PromConsole number formatter, y units) of a console graph.
CONSOLE_UNITS = {
    "short": ("humanizeNoSmallPrefix", ""),
    "s": ("humanize", "s"),
    "bytes": ("humanize1024", "B"),
    "Bps": ("humanize1024", "B/s"),
    "ops": ("humanizeNoSmallPrefix", "/s"),
    "percentunit": ("humanizeNoSmallPrefix", ""),
}

CONSOLE_STYLE = """<style>
.bmq_nav a { color: #ddd; margin-right: 1.5ex; }
.bmq_nav a.bmq_current { color: #fff; font-weight: bold; }
.bmq_nav .bmq_filter { color: #999; margin-left: 3ex; }
.bmq_panel { margin-bottom: 2ex; overflow: hidden; }
.bmq_panel h4 { font-size: 1rem; margin-bottom: 0.3ex; }
.bmq_panel_description { font-size: 0.75rem; color: #666; }
.bmq_stat td { padding-right: 2ex; }
</style>"""


def console_expr(expr):
    """A panel's PromQL as Prometheus evaluates it for a console page: the Go template text
    of a `printf` whose arguments are the page's node filter, one per `$node`."""
    expr = expr.replace("$__rate_interval", CONSOLE_RATE_INTERVAL)
    # The expression goes into a Go template raw string and a printf format.
    assert "`" not in expr and "%" not in expr and "{{" not in expr and "}}" not in expr, expr
    count = expr.count("$node")
    assert "$" not in expr.replace("$node", ""), expr
    return "(printf `" + expr.replace("$node", "%s") + "`" + " $node" * count + ")"


def js_expr(expr):
    """A panel's PromQL as a JavaScript expression for PromConsole.Graph, the node filter
    taken from the page (bmqNode)."""
    expr = expr.replace("$__rate_interval", CONSOLE_RATE_INTERVAL)
    assert "{{" not in expr and "}}" not in expr and "</" not in expr, expr
    return json.dumps(expr).replace("$node", '" + bmqNode + "')


def console_legend(legend):
    """Grafana's legend `{{label}}` is PromConsole's `[[label]]`."""
    out = re.sub(r"\{\{\s*(\w+)\s*\}\}", r"[[\1]]", legend)
    assert "{{" not in out and "}}" not in out, legend
    return out


def console_text(text):
    text = html.escape(text, quote=True)
    assert "{{" not in text and "}}" not in text, text
    return text


def console_graph(panel):
    formatter, units = CONSOLE_UNITS[panel["fieldConfig"]["defaults"]["unit"]]
    div = f"bmq-panel-{panel['id']}"
    exprs = ",\n    ".join(js_expr(t["expr"]) for t in panel["targets"])
    names = ", ".join(json.dumps(console_legend(t["legendFormat"])) for t in panel["targets"])
    return (f'<div class="bmq_graph" id="{div}"></div>\n'
            "<script>\n"
            "new PromConsole.Graph({\n"
            f'  node: document.querySelector("#{div}"),\n'
            f"  expr: [\n    {exprs}],\n"
            f"  name: [{names}],\n"
            f"  yAxisFormatter: PromConsole.NumberFormatter.{formatter},\n"
            f"  yHoverFormatter: PromConsole.NumberFormatter.{formatter},\n"
            f"  yUnits: {json.dumps(units)},\n"
            "  height: 160,\n"
            "});\n"
            "</script>\n")


def console_stat(panel):
    """A stat panel: each target's series and their current values, queried when Prometheus
    renders the page (one row per series; "no data" when a target returns none)."""
    rows = []
    for t in panel["targets"]:
        legend = console_text(re.sub(r"\{\{\s*\w+\s*\}\}", "", t["legendFormat"]).strip())
        query = console_expr(t["expr"])
        rows.append(
            f"{{{{ range query {query} | sortByLabel \"partition\" }}}}"
            f"<tr><td>{legend}</td>"
            "<td>{{ range $k, $v := .Labels }}{{ $k }}={{ $v }} {{ end }}</td>"
            '<td class="bmq_value">{{ .Value | humanize }}</td></tr>'
            "{{ else }}"
            f'<tr><td>{legend}</td><td></td><td class="bmq_value bmq_no_data">no data</td></tr>'
            "{{ end }}")
    return ('<table class="bmq_stat table table-sm">\n' + "\n".join(rows) + "\n</table>\n")


def console_page(d):
    """The Prometheus console template of dashboard `d`: the same rows, panels and queries.
    Needs only the console library's prom.lib (Debian: examples/console_libraries)."""
    links = []
    for uid, name in CONSOLE_PAGES:
        current = ' class="bmq_current"' if uid == d.uid else ""
        links.append(f'<a{current} href="{uid}.html{{{{ with .Params.node }}}}?node={{{{ . }}}}'
                     f'{{{{ end }}}}">{name}</a>')
    node_links = ('<span class="bmq_filter">nodes: <a href="{{ .Path }}">all</a>'
                  "{{ range query \"up{job='bmq'}\" | sortByLabel \"node\" }}"
                  '<a href="?node={{ .Labels.node }}">{{ .Labels.node }}</a>{{ end }}</span>')
    out = [
        "{{/* Generated by dashboards/generate.py from the panels of dashboards/grafana/"
        f"{d.uid}.json: edit that script, not this file. */}}}}",
        '{{ $node := or .Params.node ".*" }}',
        "<!doctype html>",
        '<html lang="en">',
        "<head>",
        f"<title>{console_text(d.title)}</title>",
        '{{ template "prom_console_head" }}',
        CONSOLE_STYLE,
        "<script>",
        # The graphs show the last 15 minutes unless the URL says otherwise, as Grafana does.
        "if (window.location.hash.indexOf('#pctc') !== 0) {",
        "  PromConsole.TimeControl._initialValues.duration = 900;",
        "  PromConsole.graphDefaults.duration = 900;",
        "}",
        "</script>",
        "</head>",
        "<body>",
        '<nav class="navbar fixed-top navbar-dark bg-dark bmq_nav">',
        '<div><a class="navbar-brand" href="{{ pathPrefix }}/">Prometheus</a>'
        + "".join(links) + node_links + "</div>",
        "</nav>",
        '<div id="bmq-filter" data-node="{{ $node }}" hidden></div>',
        "<script>var bmqNode = document.getElementById(\"bmq-filter\").dataset.node;</script>",
        '{{ template "prom_content_head" . }}',
        f"<h1>{console_text(d.title)}</h1>",
        f"<p>{console_text(d.description)} Node filter: <code>{{{{ $node }}}}</code>; "
        f"rates over [{CONSOLE_RATE_INTERVAL}].</p>",
    ]
    open_row = False
    for panel in d.panels:
        if panel["type"] == "row":
            if open_row:
                out.append("</div>")
            out.append(f"<h2>{console_text(panel['title'])}</h2>")
            out.append('<div class="row">')
            open_row = True
            continue
        cols = max(3, panel["gridPos"]["w"] // 2)
        out.append(f'<div class="col-md-{cols} bmq_panel" data-panel="{panel["id"]}">')
        out.append(f"<h4>{console_text(panel['title'])}</h4>")
        if panel["type"] == "stat":
            out.append(console_stat(panel))
        else:
            out.append(console_graph(panel))
        out.append(f'<p class="bmq_panel_description">{console_text(panel["description"])}</p>')
        out.append("</div>")
    if open_row:
        out.append("</div>")
    out += ['{{ template "prom_content_tail" . }}', "</body>", "</html>"]
    return "\n".join(out) + "\n"


def rate(metric, by, extra=""):
    sel = SEL + extra
    return f"sum by ({by}) (rate({metric}{{{sel}}}[$__rate_interval]))"


def increase(metric, by, extra=""):
    """Events per rate interval (for counters of rare events, where a rate would show 0.07/s)."""
    sel = SEL + extra
    return f"sum by ({by}) (increase({metric}{{{sel}}}[$__rate_interval]))"


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
            [(increase("bmq_elector_transitions_total", "reason"), "{{reason}}")])
    d.panel("Leader heartbeats missed",
            "bmq_elector_heartbeats_missed_total per node, per rate interval.",
            [(increase("bmq_elector_heartbeats_missed_total", "node"), "{{node}}")])
    d.panel("Leader heartbeat intervals (p99)",
            "bmq_elector_heartbeat_send_interval_seconds on the leader (the period is 100 ms; "
            "more means its elector thread was held up) and "
            "bmq_elector_heartbeat_receive_interval_seconds on each follower (sender, network "
            "and receiver delays together). A follower drops its leader after "
            "heartbeat_miss_count periods without one (800 ms by default).",
            [("histogram_quantile(0.99, sum by (node, le) (rate("
              f"bmq_elector_heartbeat_send_interval_seconds_bucket{{{SEL}}}[$__rate_interval])))",
              "sent {{node}}"),
             ("histogram_quantile(0.99, sum by (node, le) (rate("
              f"bmq_elector_heartbeat_receive_interval_seconds_bucket{{{SEL}}}"
              "[$__rate_interval])))", "received {{node}}")], unit="s", w=16)
    d.panel("Elector messages dropped",
            "bmq_elector_messages_dropped_total: stale, from an unknown sender or malformed, "
            "per rate interval.",
            [(increase("bmq_elector_messages_dropped_total", "node"), "{{node}}")], decimals=0)
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
    d.panel("Ledger rollovers and torn tails",
            "bmq_metadata_ledger_rollovers_total: ledger files rolled over (a snapshot of the "
            "committed state starts the next); bmq_ledger_torn_tail_truncations_total: "
            "incomplete records cut from the ledger's tail when a node started after a crash.",
            [(increase("bmq_metadata_ledger_rollovers_total", "node"), "rollovers {{node}}"),
             (increase("bmq_ledger_torn_tail_truncations_total", "node"),
              "torn tails {{node}}")], decimals=0)
    d.row("Node health")
    d.panel("Nodes up", "Prometheus `up`: 1 when the node's /metrics answered the last scrape.",
            [(f"up{{{SEL}}}", "{{node}}")], mappings=[(0, "down"), (1, "up")])
    d.panel("Peer availability",
            "bmq_peer_available: each node's view of each peer (control link up and fresh).",
            [(f"bmq_peer_available{{{SEL}}}", "{{node}} sees {{peer}}")])
    d.panel("Available members (per node's view)",
            "This node plus its available peers, against the elector quorum.",
            [(f"1 + sum by (node) (bmq_peer_available{{{SEL}}})", "{{node}}"),
             (f"max(bmq_elector_quorum{{{SEL}}})", "quorum"),
             (f"max(bmq_cluster_members{{{SEL}}})", "configured members")], decimals=0)
    d.panel("Members by role",
            "bmq_cluster_membership_members: the committed membership as the leader holds it "
            "(voters count in every quorum; learners catch up and are promoted; leaving members "
            "give up their primaries, then are removed); bmq_cluster_membership_change_in_flight:"
            " 1 while a change is proposed and not committed; the epoch rises by one per change.",
            [(f"max by (role) (bmq_cluster_membership_members{{{SEL}}} {LEADER_VIEW})",
              "{{role}}"),
             (f"max(bmq_cluster_membership_change_in_flight{{{SEL}}})", "change in flight"),
             (f"max(bmq_cluster_membership_epoch{{{SEL}}})", "epoch")], decimals=0)
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
            [(increase("bmq_queue_removed_total", "reason"), "{{reason}}")], decimals=0)
    d.panel("NACKs by reason",
            "bmq_queue_nack_total: PUTs answered with a failure status, by reason.",
            [(rate("bmq_queue_nack_total", "reason"), "{{reason}}")], unit="ops")
    d.panel("PUTs resent and duplicates dropped",
            "On the producer's node: PUTs resent to a primary after no answer or a change of "
            "primary (bmq_session_put_retransmissions_total), opens sent again "
            "(bmq_session_open_retransmissions_total), PUTs held back while the data link to "
            "their primary was interrupted, to be resent in order (bmq_proxy_puts_held_total). "
            "On the primary: resent PUTs dropped because their GUID was already stored "
            "(bmq_queue_put_duplicates_total). All rise during a failover and return to 0.",
            [(rate("bmq_session_put_retransmissions_total", "node"), "PUTs resent {{node}}"),
             (rate("bmq_session_open_retransmissions_total", "node"), "opens resent {{node}}"),
             (rate("bmq_proxy_puts_held_total", "node"), "PUTs held {{node}}"),
             (rate("bmq_queue_put_duplicates_total", "node"), "duplicates dropped {{node}}")],
            unit="ops")
    d.write()


# A partition's active primary, as the node that runs it reports (the join keeps the series of
# the node whose bmq_partition_primary_active is 1: healed and serving).
ON_PRIMARY = 'and on(instance, partition) (bmq_partition_primary_active{job="bmq"} == 1)'


def storage():
    d = Dash("bmq-storage", "bmq / Storage and replication",
             "Per partition: replication to the replicas, the journals on disk, and storage "
             "failures.")
    d.row("Replication (each partition's active primary)")
    d.panel("Uncommitted records",
            "On each partition's active primary, its last journal sequence "
            "(bmq_partition_journal_last_sequence) minus the highest one a quorum holds "
            "(bmq_partition_committed_sequence): records whose strong ACKs wait for the "
            "replicas. Near 0 while a quorum keeps up, 0 when traffic stops; growing while "
            "the commits stand still is a stall (alert BmqPartitionReplicationStalled).",
            [(f"max by (partition) ((bmq_partition_journal_last_sequence{{{SEL}}} - "
              f"bmq_partition_committed_sequence{{{SEL}}}) {ON_PRIMARY})",
              "partition {{partition}}")], decimals=0)
    d.panel("Commits per second",
            "Growth of bmq_partition_committed_sequence on each partition's active primary: "
            "records (messages, confirms, removals) that reached a quorum, per second.",
            [(f"sum by (partition) (deriv(bmq_partition_committed_sequence{{{SEL}}}"
              f"[$__rate_interval]) {ON_PRIMARY})", "partition {{partition}}")],
            unit="ops")
    d.panel("Slowest replica behind (records)",
            "bmq_partition_replication_lag_records on each partition's active primary: "
            "records its slowest replica has not acknowledged. A replica down or far behind "
            "slows nothing while a quorum holds, but the primary keeps the dead records it "
            "lacks (settled sequence below) until it catches up.",
            [(f"max by (partition) (bmq_partition_replication_lag_records{{{SEL}}} "
              f"{ON_PRIMARY})", "partition {{partition}}")], decimals=0)
    d.panel("Primaries per node",
            "Partitions each node runs as primary (bmq_partition_is_primary) and how many "
            "of them finished healing and serve (bmq_partition_primary_active).",
            [(f"sum by (node) (bmq_partition_is_primary{{{SEL}}})", "primary {{node}}"),
             (f"sum by (node) (bmq_partition_primary_active{{{SEL}}})", "active {{node}}")],
            decimals=0)
    d.panel("Primary lease per partition (per node)",
            "bmq_partition_primary_lease_id: the highest primary lease each node knows for "
            "each partition. The nodes agree once a new primary's lease has reached them.",
            [(f"max by (node, partition) (bmq_partition_primary_lease_id{{{SEL}}})",
              "{{node}} partition {{partition}}")], decimals=0, w=16)
    d.row("Journals")
    d.panel("Journal size",
            "bmq_journal_bytes: this node's journal segments per partition (the outstanding "
            "data plus about two segments); bmq_journal_live_bytes: the live records in them.",
            [(f"sum by (node) (bmq_journal_bytes{{{SEL}}})", "segments {{node}}"),
             (f"sum by (node) (bmq_journal_live_bytes{{{SEL}}})", "live {{node}}")],
            unit="bytes")
    d.panel("Journal writes",
            "bmq_journal_written_bytes_total: bytes appended to the journals per second.",
            [(rate("bmq_journal_written_bytes_total", "node"), "{{node}}")], unit="Bps")
    d.panel("Outstanding messages",
            "bmq_journal_outstanding_messages: messages in the journals that some app has "
            "neither confirmed nor had removed (every node holds them).",
            [(f"sum by (node) (bmq_journal_outstanding_messages{{{SEL}}})", "{{node}}")],
            decimals=0)
    d.panel("Journal segments",
            "bmq_journal_segments: segment files per node, all partitions.",
            [(f"sum by (node) (bmq_journal_segments{{{SEL}}})", "{{node}}")], decimals=0)
    d.panel("Journal cache",
            "bmq_journal_cache_bytes: payloads of recent records held in memory for "
            "deliveries (bounded by [storage] cache_mb per partition; 0 on a replica).",
            [(f"sum by (node) (bmq_journal_cache_bytes{{{SEL}}})", "{{node}}")],
            unit="bytes")
    d.panel("Journal positions (primary)",
            "On each partition's active primary: the last sequence, the settled sequence "
            "(bmq_journal_settled_sequence: committed and held by every in-sync replica, so "
            "dead records up to it may be removed) and the floor (bmq_journal_floor_sequence: "
            "removed from disk). A settled sequence that stops while the last grows is a "
            "replica out of sync, and the journal grows until it returns.",
            [(f"max by (partition) (bmq_partition_journal_last_sequence{{{SEL}}} "
              f"{ON_PRIMARY})", "last {{partition}}"),
             (f"max by (partition) (bmq_journal_settled_sequence{{{SEL}}} {ON_PRIMARY})",
              "settled {{partition}}"),
             (f"max by (partition) (bmq_journal_floor_sequence{{{SEL}}} {ON_PRIMARY})",
              "floor {{partition}}")], decimals=0)
    d.row("Storage failures")
    d.panel("Disk full",
            "bmq_journal_disk_full: 1 while a partition's last journal write failed for a "
            "full disk; its PUTs are NACKed STORAGE_FAILURE until a write succeeds (alert "
            "BmqJournalDiskFull).",
            [(f"max by (node, partition) (bmq_journal_disk_full{{{SEL}}})",
              "{{node}} partition {{partition}}")], mappings=[(0, "no"), (1, "full")])
    d.panel("Journal write failures",
            "bmq_journal_write_failures_total: journal writes that failed and were rolled "
            "back, by reason, per rate interval (alert BmqJournalWriteFailures).",
            [(increase("bmq_journal_write_failures_total", "node, reason"),
              "{{node}} {{reason}}")], decimals=0)
    d.panel("Torn tails, corrupt journals, undeleted files",
            "bmq_journal_torn_tail_truncations_total: incomplete records cut from a journal's "
            "tail at start (a crash mid-write leaves them; nothing ACKed is lost: an ACK waits "
            "for the fsync). bmq_journal_quarantines_total: journals found corrupt at start and "
            "set aside (the partition is re-installed from its primary; "
            "bmq_journal_needs_install is 1 until then). bmq_journal_delete_errors_total: "
            "deleted segments' files that could not be removed (the next start removes them).",
            [(increase("bmq_journal_torn_tail_truncations_total", "node"),
              "torn tails {{node}}"),
             (increase("bmq_journal_quarantines_total", "node"), "set aside {{node}}"),
             (f"sum by (node) (bmq_journal_needs_install{{{SEL}}})", "re-installing {{node}}"),
             (increase("bmq_journal_delete_errors_total", "node"), "delete errors {{node}}")],
            decimals=0)
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
            "Client frames that failed to decode, protocol violations, and requests dropped "
            "as invalid by a session (bmq_client_invalid_requests_total, e.g. a CONFIRM for "
            "a queue it did not open) or by a partition "
            "(bmq_partition_invalid_requests_total), per second.",
            [(rate("bmq_client_frame_errors_total", "node"), "bad frame {{node}}"),
             (rate("bmq_client_protocol_errors_total", "node"), "protocol {{node}}"),
             (rate("bmq_client_invalid_requests_total", "node"), "invalid request {{node}}"),
             (rate("bmq_partition_invalid_requests_total", "node"),
              "invalid at partition {{node}}")],
            unit="ops")
    d.row("Overload")
    d.panel("Requests refused for a full mailbox",
            "bmq_partition_overloaded_total: client requests a partition refused because its "
            "mailbox was full (a PUT is NACKed LIMIT_REACHED); bmq_mailbox_full_total: "
            "messages the elector or metadata actor refused for a full mailbox. Per rate "
            "interval.",
            [(increase("bmq_partition_overloaded_total", "node"), "partition {{node}}"),
             (increase("bmq_mailbox_full_total", "node, actor"), "{{actor}} {{node}}")],
            decimals=0)
    d.panel("Slow clients",
            "Events dropped because a session's inbox was full "
            "(bmq_session_inbox_dropped_total), sessions closed for it "
            "(bmq_session_inbox_overflows_total), and clients disconnected because they read "
            "nothing for the request timeout (bmq_client_write_timeouts_total). A delivery "
            "dropped this way is redelivered. Per rate interval.",
            [(increase("bmq_session_inbox_dropped_total", "node"), "events dropped {{node}}"),
             (increase("bmq_session_inbox_overflows_total", "node"),
              "sessions closed {{node}}"),
             (increase("bmq_client_write_timeouts_total", "node"), "write timeouts {{node}}")],
            decimals=0)
    d.panel("Client connections refused",
            "bmq_client_connections_refused_total: client_sessions_max reached, or too many "
            "TLS handshakes in progress. Per rate interval.",
            [(increase("bmq_client_connections_refused_total", "node"), "{{node}}")],
            decimals=0)
    d.row("Peer links")
    d.panel("Data link losses",
            "bmq_peer_data_link_losses_total: losses of the DATA link with each peer "
            "(closed, a message dropped on a full link queue, or the peer unavailable); each "
            "releases the peer's consumers here, and their messages are redelivered. Per rate "
            "interval.",
            [(increase("bmq_peer_data_link_losses_total", "node, peer"),
              "{{node}} to {{peer}}")], decimals=0)
    d.panel("Peer messages dropped",
            "bmq_peer_messages_dropped_total: messages not queued to a peer (link down or "
            "queue full), by channel; replication resends what gets no receipt. "
            "bmq_peer_messages_invalid_total: peer messages dropped as invalid. Per rate "
            "interval.",
            [(increase("bmq_peer_messages_dropped_total", "node, channel"),
              "{{channel}} {{node}}"),
             (increase("bmq_peer_messages_invalid_total", "node"), "invalid {{node}}")],
            decimals=0)
    d.panel("Peer connection errors",
            "Peer frames that failed to decode (bmq_peer_frame_errors_total), accepted peer "
            "connections closed for silence (bmq_peer_connection_timeouts_total) and peer "
            "connections refused (bmq_peer_connections_refused_total). Per rate interval.",
            [(increase("bmq_peer_frame_errors_total", "node"), "bad frame {{node}}"),
             (increase("bmq_peer_connection_timeouts_total", "node"), "timeout {{node}}"),
             (increase("bmq_peer_connections_refused_total", "node"), "refused {{node}}")],
            decimals=0)
    d.row("Security")
    d.panel("Authentication failures",
            "Hellos with a token no [[auth.tokens]] entry matches "
            "(bmq_client_auth_failures_total), failed client TLS handshakes "
            "(bmq_client_tls_failures_total), peers that failed TLS or whose certificate does "
            "not name the member they claim (bmq_peer_auth_failures_total; alert "
            "BmqPeerAuthFailures), state-changing admin requests without a valid token "
            "(bmq_admin_auth_failures_total). Per rate interval.",
            [(increase("bmq_client_auth_failures_total", "node"), "client token {{node}}"),
             (increase("bmq_client_tls_failures_total", "node"), "client TLS {{node}}"),
             (increase("bmq_peer_auth_failures_total", "node"), "peer {{node}}"),
             (increase("bmq_admin_auth_failures_total", "node"), "admin {{node}}")],
            decimals=0)
    d.panel("Opens refused NOT_AUTHORIZED",
            "bmq_client_unauthorized_total: OpenQueue requests refused because the session's "
            "token lacks produce or consume on the queue's domain. Per rate interval.",
            [(increase("bmq_client_unauthorized_total", "node"), "{{node}}")], decimals=0)
    d.row("BlazingMQ SDK clients (bmqp listener)")
    d.panel("bmqp connections",
            "bmq_bmqp_connections_total: connections accepted on the bmqp listener, per "
            "second.",
            [(rate("bmq_bmqp_connections_total", "node"), "{{node}}")], unit="ops")
    d.panel("bmqp errors by reason",
            "bmq_bmqp_errors_total: bad input from BlazingMQ SDK clients by reason (see "
            "docs/METRICS.md: most close that connection; crc and put_data NACK the PUT). Per "
            "rate interval.",
            [(increase("bmq_bmqp_errors_total", "reason"), "{{reason}}")], decimals=0)
    d.panel("bmqp compressed PUTs",
            "bmq_bmqp_puts_decompressed_total: PUTs that arrived zlib-compressed and were "
            "inflated, per second.",
            [(rate("bmq_bmqp_puts_decompressed_total", "node"), "{{node}}")], unit="ops")
    d.write()


if __name__ == "__main__":
    cluster()
    queues()
    storage()
    node()
    if STALE:
        sys.exit("out of date (run python3 dashboards/generate.py): " + ", ".join(STALE))
