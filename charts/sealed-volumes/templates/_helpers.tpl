{{/* The chart name, or nameOverride. */}}
{{- define "sealed-volumes.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or fullnameOverride; the release name alone when it contains the chart name. */}}
{{- define "sealed-volumes.fullname" -}}
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

{{- define "sealed-volumes.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sealed-volumes.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sealed-volumes
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "operator"). */}}
{{- define "sealed-volumes.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sealed-volumes.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sealed-volumes.tag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* One component's image: (dict "ctx" $ "name" "sealed-operator" "image" .Values.operator.image).
     Its own repository (a full repository) or <image.repository>/<name>; its own tag, or
     image.tag, or the appVersion; a digest, when given, pins it (repository@digest). */}}
{{- define "sealed-volumes.image" -}}
{{- $own := .image | default dict }}
{{- $repository := $own.repository | default (printf "%s/%s" (trimSuffix "/" .ctx.Values.image.repository) .name) }}
{{- if $own.digest }}
{{- printf "%s@%s" $repository $own.digest }}
{{- else }}
{{- printf "%s:%s" $repository ($own.tag | default (include "sealed-volumes.tag" .ctx)) }}
{{- end }}
{{- end }}

{{- define "sealed-volumes.operatorImage" -}}
{{- include "sealed-volumes.image" (dict "ctx" . "name" "sealed-operator" "image" .Values.operator.image) }}
{{- end }}

{{- define "sealed-volumes.csiImage" -}}
{{- include "sealed-volumes.image" (dict "ctx" . "name" "sealed-csi" "image" .Values.node.image) }}
{{- end }}

{{/* Whether an image is the local placeholder (hack/images.sh), not a release. */}}
{{- define "sealed-volumes.localImages" -}}
{{- if or (hasPrefix "sealed.local/" (include "sealed-volumes.operatorImage" .)) (hasPrefix "sealed.local/" (include "sealed-volumes.csiImage" .)) }}true{{ end }}
{{- end }}

{{/* SEALED_LOG and SEALED_LOG_JSON, read by every binary (logging.level, logging.format). */}}
{{- define "sealed-volumes.logEnv" -}}
- name: SEALED_LOG
  value: {{ .Values.logging.level | quote }}
- name: SEALED_LOG_JSON
  value: {{ eq .Values.logging.format "json" | quote }}
{{- end }}

{{- define "sealed-volumes.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "sealed-volumes.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sealed-volumes.nodeServiceAccount" -}}
{{- if .Values.node.serviceAccount.create }}
{{- default (printf "%s-node" (include "sealed-volumes.fullname" .)) .Values.node.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.node.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret with the store credentials, or "" when there is none. */}}
{{- define "sealed-volumes.storeSecret" -}}
{{- if .Values.store.existingSecret }}
{{- .Values.store.existingSecret }}
{{- else if .Values.store.credentials }}
{{- printf "%s-store" (include "sealed-volumes.fullname" .) }}
{{- end }}
{{- end }}

{{- define "sealed-volumes.storeUrl" -}}
{{- required "store.url is required: the object store of chunks and manifests, e.g. --set store.url=s3://bucket/prefix (see docs/helm.md)" .Values.store.url }}
{{- end }}

{{/* Store flags and credentials, shared by the operator and the node plugin. */}}
{{- define "sealed-volumes.storeArgs" -}}
- --store={{ include "sealed-volumes.storeUrl" . }}
{{- with .Values.store.endpoint }}
- --store-endpoint={{ . }}
{{- end }}
{{- with .Values.store.region }}
- --store-region={{ . }}
{{- end }}
{{- end }}

{{/* The excluded GPU products as node-label values: each as given and with -SHARED. */}}
{{- define "sealed-volumes.excludedGpuLabelValues" -}}
{{- $out := list }}
{{- range .Values.node.excludedGpuProducts }}
{{- $out = append $out . }}
{{- $out = append $out (printf "%s-SHARED" .) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The node plugin's (and the fd holder's) affinity: node.affinity with the GPU exclusion
     added to every node selector term. */}}
{{- define "sealed-volumes.nodeAffinity" -}}
{{- $excluded := include "sealed-volumes.excludedGpuLabelValues" . | fromJsonArray }}
{{- $affinity := deepCopy .Values.node.affinity }}
{{- if $excluded }}
{{- $gpu := dict "key" "nvidia.com/gpu.product" "operator" "NotIn" "values" $excluded }}
{{- $nodeAffinity := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := get $required "nodeSelectorTerms" | default list }}
{{- if not $terms }}
{{- $terms = list (dict "matchExpressions" (list $gpu)) }}
{{- else }}
{{- /* Terms are ORed: the exclusion has to hold in each of them. */}}
{{- $withGpu := list }}
{{- range $terms }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (append (get $term "matchExpressions" | default list) $gpu) }}
{{- $withGpu = append $withGpu $term }}
{{- end }}
{{- $terms = $withGpu }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- end }}
{{- with $affinity }}
{{- toYaml . }}
{{- end }}
{{- end }}
