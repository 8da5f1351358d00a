{{/* Resource name prefix: <release>-<chart name>, at most 63 characters. */}}
{{- define "bmq.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (default .Chart.Name .Values.nameOverride) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bmq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The headless Service that gives every pod its stable DNS name. */}}
{{- define "bmq.headless" -}}
{{- printf "%s-headless" (include "bmq.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bmq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bmq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bmq.labels" -}}
{{ include "bmq.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The stable DNS name of pod ordinal .ordinal (node id ordinal+1); .ordinal may be the
start script's placeholder @ORDINAL@. */}}
{{- define "bmq.podHost" -}}
{{- $root := .root -}}
{{- printf "%s-%v.%s.%s.svc.%s" (include "bmq.fullname" $root) .ordinal (include "bmq.headless" $root) $root.Release.Namespace $root.Values.clusterDomain -}}
{{- end -}}

{{/* One [[members]] table of the broker configuration: node .id at pod ordinal .ordinal
(numbers, or the start script's placeholders @NODE_ID@ and @ORDINAL@). */}}
{{- define "bmq.memberTable" -}}
{{- $v := .root.Values -}}
[[members]]
id = {{ .id }}
host = {{ include "bmq.podHost" (dict "root" .root "ordinal" .ordinal) | quote }}
client_port = {{ int $v.ports.client }}
peer_port = {{ int $v.ports.peer }}
admin_port = {{ int $v.ports.admin }}
{{- if $v.ports.bmqp }}
bmqp_port = {{ int $v.ports.bmqp }}
{{- end }}
{{- end -}}

{{/* The size of the cluster's first member set: cluster.initialMembers, or replicas when it is
null. Pods with a lower ordinal list these members; the others join. */}}
{{- define "bmq.initialMembers" -}}
{{- $v := .Values.cluster.initialMembers -}}
{{- if kindIs "invalid" $v -}}
{{- int .Values.replicas -}}
{{- else -}}
{{- int $v -}}
{{- end -}}
{{- end -}}

{{- define "bmq.tlsSecretPrefix" -}}
{{- default (printf "%s-tls-node" (include "bmq.fullname" .)) .Values.tls.secretPrefix -}}
{{- end -}}

{{- define "bmq.authSecret" -}}
{{- default (printf "%s-auth" (include "bmq.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Seconds Kubernetes grants a stopping pod: above the broker's own graceful stop bound. */}}
{{- define "bmq.terminationGracePeriod" -}}
{{- $stop := div (add .Values.broker.gracefulStopTimeoutMs 999) 1000 -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add $stop 20 -}}
{{- else -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $stop) -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed broker.gracefulStopTimeoutMs (%v s)" .Values.terminationGracePeriodSeconds $stop) -}}
{{- end -}}
{{- .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* Checks of values that would render a cluster that cannot start. */}}
{{- define "bmq.validate" -}}
{{- $n := int .Values.replicas -}}
{{- if or (lt $n 1) (gt $n 7) -}}
{{- fail (printf "replicas must be 1 to 7 (a bmq cluster has at most 7 members), not %v" .Values.replicas) -}}
{{- end -}}
{{- $initial := .Values.cluster.initialMembers -}}
{{- if not (kindIs "invalid" $initial) -}}
{{- if not (or (kindIs "int" $initial) (kindIs "int64" $initial) (and (kindIs "float64" $initial) (eq (float64 $initial) (float64 (int $initial))))) -}}
{{- fail (printf "cluster.initialMembers must be null or a whole number of nodes, not %v" $initial) -}}
{{- end -}}
{{- if or (lt (int $initial) 1) (gt (int $initial) 7) -}}
{{- fail (printf "cluster.initialMembers must be 1 to 7 (a bmq cluster has at most 7 members), not %v" $initial) -}}
{{- end -}}
{{- if and .Release.IsInstall (gt (int $initial) $n) -}}
{{- fail (printf "cluster.initialMembers (%v) must not exceed replicas (%v) at install: the first members would have no pods" $initial $n) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.enabled) -}}
{{- fail "tls.certManager.enabled needs tls.enabled" -}}
{{- end -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (lt (len .Values.auth.adminToken) 16) -}}
{{- fail "auth.enabled needs auth.existingSecret or an auth.adminToken of at least 16 bytes" -}}
{{- end -}}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled -}}
{{- fail "enable one of monitoring.podMonitor and monitoring.serviceMonitor, not both (each pod would be scraped twice)" -}}
{{- end -}}
{{- end -}}

{{/* Relabelings shared by the PodMonitor and the ServiceMonitor: the job and node labels the
dashboards and alert rules select on (job "bmq", node = node id = pod ordinal + 1). */}}
{{- define "bmq.scrapeRelabelings" -}}
- action: replace
  targetLabel: job
  replacement: bmq
{{- range $i := until (int .Values.replicas) }}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_name]
  regex: {{ printf "%s-%d" (include "bmq.fullname" $) $i | quote }}
  targetLabel: node
  replacement: {{ add $i 1 | quote }}
{{- end }}
{{- end -}}
