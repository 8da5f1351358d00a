#!/usr/bin/env bash
# Copies the Grafana dashboards (dashboards/grafana/*.json) and the alert rules
# (dashboards/prometheus/alerts.yml) into the Helm chart (deploy/helm/bmq/files/): Helm reads
# no file outside a chart's directory. Run it after changing either; scripts/helm_check.py
# (tests/tests/helm.rs) fails while the copies differ.
set -euo pipefail
cd "$(dirname "$0")/.."
files=deploy/helm/bmq/files
rm -f "$files"/*.json
cp dashboards/grafana/*.json "$files"/
cp dashboards/prometheus/alerts.yml "$files"/alerts.yml
echo "helm-sync-files: copied $(ls dashboards/grafana/*.json | wc -l) dashboards and alerts.yml into $files" >&2
