{{/* Names and labels shared by every template. */}}
{{- define "tailwarden.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tailwarden.operatorName" -}}
{{- printf "%s-operator" (include "tailwarden.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tailwarden.webhookServiceName" -}}
{{- printf "%s-webhook" (include "tailwarden.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tailwarden.webhookConfigName" -}}
{{- include "tailwarden.fullname" . -}}
{{- end -}}

{{- define "tailwarden.tlsSecretName" -}}
{{- printf "%s-webhook-tls" (include "tailwarden.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tailwarden.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tailwarden.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tailwarden.labels" -}}
app.kubernetes.io/name: tailwarden
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tailwarden.operatorSelector" -}}
app.kubernetes.io/name: tailwarden
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* registry/repository:tag (no registry part when image.registry is empty). */}}
{{- define "tailwarden.image" -}}
{{- $registry := trimSuffix "/" (default "" .root.Values.image.registry) -}}
{{- $ref := printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- if $registry -}}{{ printf "%s/%s" $registry $ref }}{{- else -}}{{ $ref }}{{- end -}}
{{- end -}}

{{- define "tailwarden.operatorImage" -}}
{{- include "tailwarden.image" (dict "root" . "image" .Values.operator.image) -}}
{{- end -}}

{{- define "tailwarden.sidecarImage" -}}
{{- include "tailwarden.image" (dict "root" . "image" .Values.sidecar.image) -}}
{{- end -}}

{{/* The rules the controller needs in each namespace whose routes it reconciles. */}}
{{- define "tailwarden.routeRules" }}
- apiGroups: ["tailwarden.io"]
  resources: ["inferenceroutes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["tailwarden.io"]
  resources: ["inferenceroutes/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
