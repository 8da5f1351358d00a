"""Fixtures of the BlazingMQ SDK acceptance suite (test_sdk.py): where the cluster is.

The suite runs the official Python SDK (`blazingmq`, PyPI; scripts/sdk-venv.sh provisions it)
against a REAL running cluster, started by the Rust test that runs pytest. Everything comes
from environment variables:

- BMQ_BROKER_URI: tcp://127.0.0.1:PORT, the bmqp (BlazingMQ client protocol) listener of
  node 1. The SDK itself lets this variable override the `broker=` argument of every session,
  which would make connecting to another node impossible; so it is read here and removed from
  this process's environment at import, and every session names its broker explicitly.
- BMQ_SDK_BROKERS: comma-separated tcp://127.0.0.1:PORT bmqp listeners of nodes 1..N, in
  node-id order (default: BMQ_BROKER_URI alone).
- BMQ_SDK_DOMAIN: the domain of the test queues, e.g. bmq.test (queue URIs are
  bmq://<domain>/<name>; every test uses a fresh uuid-based name).
- BMQ_SDK_FANOUT_DOMAIN: a fanout domain whose app ids include foo and bar.
- BMQCTL: path of the `bmqctl` binary; BMQ_BROKERS: comma-separated host:port client
  listeners of our own protocol (bmqctl reads it; the subprocesses inherit the environment).
- BMQ_TEST_NODES: comma-separated id:pid:admin_host:admin_port of every node (the destructive
  test kills a node and reads GET http://admin/status).

A test whose variables are missing is skipped, with the variable named in the reason.
"""

import collections
import os
import uuid

import pytest

# Read once and removed, see the module doc (os.environ.pop also unsets it for the SDK's
# C++ getenv).
BROKER_URI = os.environ.pop("BMQ_BROKER_URI", None)

Node = collections.namedtuple("Node", "id pid admin")


def _require(name):
    value = os.environ.get(name, "").strip()
    if not value:
        pytest.skip(f"environment variable {name} is not set")
    return value


@pytest.fixture
def broker_uri():
    """tcp://host:port of node 1's bmqp listener (BMQ_BROKER_URI)."""
    if not BROKER_URI:
        pytest.skip("environment variable BMQ_BROKER_URI is not set")
    return BROKER_URI


@pytest.fixture
def sdk_brokers(broker_uri):
    """The bmqp listeners of nodes 1..N (BMQ_SDK_BROKERS); index = node id - 1."""
    value = os.environ.get("BMQ_SDK_BROKERS", "").strip()
    if not value:
        return [broker_uri]
    return [b.strip() for b in value.split(",") if b.strip()]


@pytest.fixture
def domain():
    """The domain of the test queues (BMQ_SDK_DOMAIN)."""
    return _require("BMQ_SDK_DOMAIN")


@pytest.fixture
def fanout_domain():
    """A fanout domain whose app ids include foo and bar (BMQ_SDK_FANOUT_DOMAIN)."""
    return _require("BMQ_SDK_FANOUT_DOMAIN")


@pytest.fixture
def queue_uri(domain, request):
    """A fresh queue bmq://<domain>/sdk-<test>-<uuid>, used by this test only."""
    name = request.node.name.replace("test_", "", 1).replace("_", "-")[:40]
    return f"bmq://{domain}/sdk-{name}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def bmqctl():
    """Path of the bmqctl binary (BMQCTL); BMQ_BROKERS must be set for it too."""
    path = _require("BMQCTL")
    _require("BMQ_BROKERS")
    if not os.access(path, os.X_OK):
        pytest.fail(f"BMQCTL={path} is not an executable file")
    return path


@pytest.fixture
def nodes():
    """Every node as Node(id, pid, admin 'host:port'), from BMQ_TEST_NODES, by id."""
    out = []
    for item in _require("BMQ_TEST_NODES").split(","):
        node_id, pid, host, port = item.strip().split(":")
        out.append(Node(int(node_id), int(pid), f"{host}:{port}"))
    return sorted(out)
