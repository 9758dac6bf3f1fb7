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
