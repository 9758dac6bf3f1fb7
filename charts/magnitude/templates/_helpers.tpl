{{- define "magnitude.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "magnitude.labels" -}}
app.kubernetes.io/name: magnitude-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "magnitude.selectorLabels" -}}
app.kubernetes.io/name: magnitude-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "magnitude.serviceAccountName" -}}
{{- default (include "magnitude.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* A histogram bound as its `le` label reads in Prometheus: prometheus_client writes floats the
way Python prints them ("5.0", "2.5") and Prometheus 3 normalises every `le` to that form,
while Helm would print a whole number as "5" and match no series. */}}
{{- define "magnitude.promLe" -}}
{{- $v := . | float64 -}}
{{- if eq $v (floor $v) -}}{{ printf "%.1f" $v }}{{- else -}}{{ $v }}{{- end -}}
{{- end -}}
