{{/* Name of the chart, or nameOverride. */}}
{{- define "culvert.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, prefixed with the chart name unless it already contains it. */}}
{{- define "culvert.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "culvert.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "culvert.labels" -}}
helm.sh/chart: {{ include "culvert.chart" . }}
{{ include "culvert.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: culvert
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the operator's pods. */}}
{{- define "culvert.selectorLabels" -}}
app.kubernetes.io/name: {{ include "culvert.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "culvert.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "culvert.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the API key (and, when edge.url is empty, the edge URL). */}}
{{- define "culvert.credentialsSecret" -}}
{{- default (printf "%s-credentials" (include "culvert.fullname" .)) .Values.credentials.existingSecret }}
{{- end }}

{{/* Whether the operator trusts a CA bundle of its own (edge.caBundle or edge.caBundleFrom). */}}
{{/* The edge URL(s) from the values, comma-separated (CULVERT_EDGE); empty: from the Secret. */}}
{{- define "culvert.edgeUrl" -}}
{{- if .Values.edge.urls }}{{ join "," .Values.edge.urls }}{{ else }}{{ .Values.edge.url }}{{ end }}
{{- end }}

{{- define "culvert.hasCA" -}}
{{- if or .Values.edge.caBundle .Values.edge.caBundleFrom }}true{{ end }}
{{- end }}

{{/* The volume holding the edge CA as the file ca.crt. */}}
{{- define "culvert.caVolume" -}}
{{- with .Values.edge.caBundleFrom.configMapKeyRef }}
configMap:
  name: {{ .name }}
  items:
    - key: {{ .key }}
      path: ca.crt
{{- else }}
{{- with .Values.edge.caBundleFrom.secretKeyRef }}
secret:
  secretName: {{ .name }}
  items:
    - key: {{ .key }}
      path: ca.crt
{{- else }}
configMap:
  name: {{ include "culvert.fullname" $ }}-edge-ca
{{- end }}
{{- end }}
{{- end }}

{{/* The pods' affinity: .Values.affinity, else the podAntiAffinity preset. */}}
{{- define "culvert.affinity" -}}
{{- if .Values.affinity }}
{{- toYaml .Values.affinity }}
{{- else if eq .Values.podAntiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "culvert.selectorLabels" . | nindent 12 }}
{{- else if eq .Values.podAntiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "culvert.selectorLabels" . | nindent 10 }}
{{- end }}
{{- end }}

{{- define "culvert.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Checks that a JSON schema cannot express; each failure says what to change.
*/}}
{{- define "culvert.validate" -}}
{{- if and .Values.credentials.apiKey .Values.credentials.existingSecret }}
{{- fail "credentials: set either credentials.apiKey (the chart creates the Secret) or credentials.existingSecret (you created it), not both" }}
{{- end }}
{{- if and .Values.edge.caBundle .Values.edge.caBundleFrom }}
{{- fail "edge: set either edge.caBundle (the PEM text) or edge.caBundleFrom (your ConfigMap or Secret), not both" }}
{{- end }}
{{- with .Values.edge.caBundleFrom }}
{{- if and .configMapKeyRef .secretKeyRef }}
{{- fail "edge.caBundleFrom: set one of configMapKeyRef and secretKeyRef, not both" }}
{{- end }}
{{- end }}
{{- if and .Values.ingressClass.default (not .Values.ingressClass.enabled) }}
{{- fail "ingressClass.default is true but ingressClass.enabled is false: the chart can only mark the IngressClass it creates as the default" }}
{{- end }}
{{- with .Values.edge.url }}
{{- if not (regexMatch "^https://[^/?#@\\s]+/?$" .) }}
{{- fail (printf "edge.url %q: give the edge's base URL as https://HOST or https://HOST:PORT (TLS only, no path)" .) }}
{{- end }}
{{- end }}
{{- if and .Values.edge.url .Values.edge.urls }}
{{- fail "edge.url and edge.urls are both set: give one edge in edge.url, or every edge in edge.urls" }}
{{- end }}
{{- range .Values.edge.urls }}
{{- if not (regexMatch "^https://[^/?#@,\\s]+/?$" .) }}
{{- fail (printf "edge.urls: %q: give each edge's base URL as https://HOST or https://HOST:PORT (TLS only, no path)" .) }}
{{- end }}
{{- end }}
{{- with .Values.credentials.apiKey }}
{{- if hasPrefix "culvert_a_" . }}
{{- fail "credentials.apiKey is an admin key (culvert_a_...): never put it in a cluster; make an endpoints key with `culvert admin api-key create --name operator --scope endpoints`" }}
{{- else if hasPrefix "culvert_t_" . }}
{{- fail "credentials.apiKey is a tunnel key (culvert_t_...): the operator needs an endpoints key, made with `culvert admin api-key create --name operator --scope endpoints`; it mints tunnel keys itself" }}
{{- else if not (regexMatch "^culvert_e_[A-Za-z0-9_-]+$" .) }}
{{- fail "credentials.apiKey is not a culvert endpoints key (culvert_e_...): make one with `culvert admin api-key create --name operator --scope endpoints`" }}
{{- end }}
{{- end }}
{{- if and .Values.credentials.apiKey (not (include "culvert.edgeUrl" .)) }}
{{- fail "credentials.apiKey is set but edge.url is empty: the Secret the chart makes holds only the key, so set edge.url=https://EDGE (or edge.urls) as well (or put both in your own Secret and use credentials.existingSecret)" }}
{{- end }}
{{- with .Values.proxy.httpsProxy }}
{{- if not (regexMatch "^https?://[^/\\s]+/?$" .) }}
{{- fail (printf "proxy.httpsProxy %q: give the proxy as http://HOST:PORT (user:password@ allowed)" .) }}
{{- end }}
{{- end }}
{{- if and .Values.edge.caBundle (not (contains "-----BEGIN CERTIFICATE-----" .Values.edge.caBundle)) }}
{{- fail "edge.caBundle must be PEM text containing -----BEGIN CERTIFICATE----- (paste the edge's ca.pem, not a path to it)" }}
{{- end }}
{{- end }}
