{{- /* The app.kubernetes.io/name label: the chart's name, or nameOverride. */ -}}
{{- define "gpu-ready.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The name of the release's objects (DaemonSet, ServiceAccount, ClusterRole, admission policies, ...):
fullnameOverride, else <release>-<name> (only <release> when it already contains the name). */ -}}
{{- define "gpu-ready.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* Label values quoted: a release named y, on, no or 1 is a string, not a YAML boolean or number. */ -}}
{{- define "gpu-ready.labels" -}}
app.kubernetes.io/name: {{ include "gpu-ready.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end -}}

{{- define "gpu-ready.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-ready.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{- define "gpu-ready.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpu-ready.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The image: repository@digest when image.digest is set (a release's chart pins the digest it pushed), else
repository:tag (tag defaults to the chart's appVersion). */ -}}
{{- /* global.imageRegistry (an umbrella chart's mirror) replaces the registry of image.repository: its first
path part when that names a host (has a dot or a port, or is localhost), else it is put in front. */ -}}
{{- define "gpu-ready.image" -}}
{{- $repo := .Values.image.repository -}}
{{- $registry := get (.Values.global | default dict) "imageRegistry" | default "" | toString -}}
{{- if $registry -}}
{{- $parts := splitList "/" $repo -}}
{{- $host := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $host) (contains ":" $host) (eq $host "localhost")) -}}
{{- $repo = join "/" (rest $parts) -}}
{{- end -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" $registry) $repo -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- /* "true" when the agent reads pod-resources (podResources.enabled, or config.podResources), else "". */ -}}
{{- define "gpu-ready.podResources" -}}
{{- if or .Values.podResources.enabled (eq (toString (index .Values.config "podResources")) "true") -}}true{{- end -}}
{{- end -}}

{{- define "gpu-ready.preflightName" -}}
{{- printf "%s-preflight" (include "gpu-ready.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The user names the apiserver gives the agent's and preflight's ServiceAccount tokens. */ -}}
{{- define "gpu-ready.agentUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpu-ready.serviceAccountName" .) -}}
{{- end -}}

{{- /* "true" when the agent labels its own Node <preflight.needsLabel>=true after a GPU fault latches:
       config.preflightAfterFault, which follows config.requirePreflight when unset. */ -}}
{{- define "gpu-ready.marksAfterFault" -}}
{{- $v := index .Values.config "preflightAfterFault" -}}
{{- if kindIs "invalid" $v }}{{ toString (eq (toString .Values.config.requirePreflight) "true") }}{{ else }}{{ toString (eq (toString $v) "true") }}{{ end -}}
{{- end -}}

{{- /* The controller (preflight.auto): its ServiceAccount user, name and the brake ConfigMap's name. */ -}}
{{- define "gpu-ready.controllerName" -}}
{{- printf "%s-controller" (include "gpu-ready.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-ready.controllerUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpu-ready.controllerName" .) -}}
{{- end -}}

{{- define "gpu-ready.brakeName" -}}
{{- printf "%s-brake" (include "gpu-ready.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-ready.brakeOn" -}}
{{- toString (and .Values.preflight.auto.enabled .Values.preflight.auto.brake.enabled) -}}
{{- end -}}

{{- define "gpu-ready.preflightUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpu-ready.preflightName" .) -}}
{{- end -}}

{{- /* A policy validation: the Node's metadata is unchanged (labels and annotations unless told not to check
       them here because the policy has finer rules for them). */ -}}
{{- define "gpu-ready.policy.metadataUnchanged" -}}
- expression: >-
    !variables.isUpdate || (
    {{- if .labels }}
    object.metadata.?labels.orValue({}) == oldObject.metadata.?labels.orValue({}) &&
    {{- end }}
    {{- if .annotations }}
    object.metadata.?annotations.orValue({}) == oldObject.metadata.?annotations.orValue({}) &&
    {{- end }}
    object.metadata.?finalizers.orValue([]) == oldObject.metadata.?finalizers.orValue([]) &&
    object.metadata.?ownerReferences.orValue([]) == oldObject.metadata.?ownerReferences.orValue([]))
  message: >-
    {{ .who }} may not change the Node's metadata ({{ if .labels }}labels, annotations, {{ end }}finalizers,
    ownerReferences)
  reason: Forbidden
{{- end -}}

{{- /* One step of the preflight Job (cordon, gates, record): image, args, env, security context and the
       volume mounts every step has; the caller appends its own mounts. */ -}}
{{- define "gpu-ready.preflight.container" -}}
{{- $v := .root.Values -}}
image: {{ include "gpu-ready.image" .root }}
imagePullPolicy: {{ $v.image.pullPolicy }}
args:
  - preflight
  - --step={{ .step }}
  - --profile=/etc/gpu-ready-preflight/profile.yaml
  {{- if ne .step "gates" }}
  - --node=$(NODE_NAME)
  {{- end }}
  {{- if ne .step "cordon" }}
  - --results=/results/results.json
  {{- end }}
  {{- if eq .step "record" }}
  - --needs-label={{ $v.preflight.needsLabel }}
  - --label-key={{ $v.config.preflightLabel }}
  - --event-namespace={{ $v.events.namespace }}
  {{- end }}
  {{- range $v.preflight.extraArgs }}
  - {{ . | quote }}
  {{- end }}
env:
  - name: NODE_NAME
    valueFrom:
      fieldRef:
        apiVersion: v1
        fieldPath: spec.nodeName
  {{- if eq .step "gates" }}
  - name: NVIDIA_VISIBLE_DEVICES
    value: {{ $v.nvidiaVisibleDevices | quote }}
  - name: NVIDIA_DRIVER_CAPABILITIES
    value: "compute,utility"
  {{- else }}
  - name: NVIDIA_VISIBLE_DEVICES   # no GPU for the steps that hold the token
    value: void
  {{- end }}
  {{- with $v.agent.extraEnv }}
  {{- /* a fieldRef's apiVersion stated (the apiserver's default): the controller's policy compares exactly */}}
  {{- $env := list }}
  {{- range $e := . }}
  {{- $e = deepCopy $e }}
  {{- if and (kindIs "map" $e.valueFrom) (kindIs "map" ($e.valueFrom | default dict).fieldRef) (not (hasKey $e.valueFrom.fieldRef "apiVersion")) }}
  {{- $_ := set $e.valueFrom.fieldRef "apiVersion" "v1" }}
  {{- end }}
  {{- $env = append $env $e }}
  {{- end }}
  {{- toYaml $env | nindent 2 }}
  {{- end }}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  runAsUser: 65532
  capabilities:
    drop: ["ALL"]
terminationMessagePath: /dev/termination-log
terminationMessagePolicy: File
resources: {}
volumeMounts:
  - name: profile
    mountPath: /etc/gpu-ready-preflight
    readOnly: true
  - name: tmp
    mountPath: /tmp
{{- end -}}

{{- /* The field manager the agent and preflight write as (the apiserver takes it from their User-Agent,
       gpu-ready/<version>). */ -}}
{{- define "gpu-ready.fieldManager" -}}gpu-ready{{- end -}}

{{- /* CEL, true when the fieldsV1 set .n is the set .m with at most some keys gone: at each level the keys in
       .tree.free may be missing from .n (never changed), the keys in .tree.nested are compared one level down
       with their own tree, every other key is equal. That is all an update changes in another manager's entry:
       the apiserver takes from it the fields the update changed. */ -}}
{{- define "gpu-ready.cel.fieldsWithin" -}}
{{- $n := .n }}{{ $m := .m }}{{ $nested := .tree.nested | default dict }}
{{- $nk := keys $nested | sortAlpha }}
{{- $skip := concat (.tree.free | default list) $nk }}
({{ $m }}.all(k, k in {{ toJson $skip }} || (k in {{ $n }} && {{ $n }}[k] == {{ $m }}[k]))
&& {{ $n }}.all(k, k in {{ $m }} && (k in {{ toJson $nk }} || {{ $n }}[k] == {{ $m }}[k]))
{{- range $p := $nk }}
&& {{ include "gpu-ready.cel.fieldsWithin" (dict "n" (printf "%s[?%s].orValue({})" $n (quote $p)) "m" (printf "%s[?%s].orValue({})" $m (quote $p)) "tree" (get $nested $p)) }}
{{- end }})
{{- end -}}

{{- /* A policy validation: metadata.managedFields as only the apiserver changes them for a write of .tree's
       fields (the writer's own entries, manager gpu-ready, are its own; every other manager's entry keeps its
       identity and time and may only lose fields of .tree). A write of nodes/status cannot set managedFields
       (the apiserver keeps the stored ones for a subresource), so only writes of the Node itself are checked. */ -}}
{{- define "gpu-ready.policy.managedFields" -}}
{{- $own := include "gpu-ready.fieldManager" . | quote }}
{{- $ident := `n.?manager == m.?manager && n.?operation == m.?operation
    && n.?subresource.orValue("") == m.?subresource.orValue("") && n.?apiVersion.orValue("") == m.?apiVersion.orValue("")
    && n.?time == m.?time` }}
{{- $within := include "gpu-ready.cel.fieldsWithin" (dict "n" `n.?fieldsV1.orValue({})` "m" `m.?fieldsV1.orValue({})` "tree" .tree) }}
{{- $gone := include "gpu-ready.cel.fieldsWithin" (dict "n" `{}` "m" `m.?fieldsV1.orValue({})` "tree" .tree) }}
- expression: >-
    !variables.isUpdate || request.?subResource.orValue("") != "" || (
    oldObject.metadata.?managedFields.orValue([]).all(m, m.?manager.orValue("") == {{ $own }}
    || object.metadata.?managedFields.orValue([]).exists(n, {{ $ident | nindent 4 }}
    && {{ $within | nindent 4 }})
    || {{ $gone | nindent 4 }})
    && object.metadata.?managedFields.orValue([]).all(n, n.?manager.orValue("") == {{ $own }}
    || oldObject.metadata.?managedFields.orValue([]).exists(m, {{ $ident | nindent 4 }}
    && {{ $within | nindent 4 }})))
  message: >-
    {{ .who }} may not change metadata.managedFields (only the apiserver changes them, for the fields the write
    changes)
  reason: Forbidden
{{- end -}}

{{- /* Names the admission policies exempt for gpu-ready's tokens must be gpu-ready's own: never kubelet's
       conditions, a Kubernetes-reserved prefix (kubernetes.io/, k8s.io/ and their subdomains: node.kubernetes.io/,
       node-role.kubernetes.io/, ...; for the taint, Cluster Autoscaler's startup-taint.cluster-autoscaler.kubernetes.io/
       and its status and ignore siblings, and the Node Readiness Controller's readiness.k8s.io/, are allowed: they
       are made for taints of one's own) or another component's
       taint or label. The agent refuses the same names
       (agent/settings.py own_condition_type, own_taint_key, own_label_key). Renders nothing. */ -}}
{{- define "gpu-ready.validateNames" -}}
{{- $reserved := `^([a-z0-9.-]+\.)?(kubernetes\.io|k8s\.io)/` }}
{{- /* Prefixes made for one's own taints: Cluster Autoscaler's (startup-taint... for a node that joins tainted)
       and the Node Readiness Controller's (readiness.k8s.io/<name>, the taint its NodeReadinessRule manages). */}}
{{- $ownTaint := `^((startup|status|ignore)-taint\.cluster-autoscaler\.kubernetes\.io|readiness\.k8s\.io)/` }}
{{- $checks := list
  (list "conditionType" .Values.conditionType (list "Ready" "MemoryPressure" "DiskPressure" "PIDPressure" "NetworkUnavailable"))
  (list "taints.key" .Values.taints.key (list "nvidia.com/gpu" "CriticalAddonsOnly" "ToBeDeletedByClusterAutoscaler" "DeletionCandidateOfClusterAutoscaler"))
  (list "config.preflightLabel" (toString .Values.config.preflightLabel) (list "nvidia.com/gpu.present"))
  (list "preflight.needsLabel" .Values.preflight.needsLabel (list "nvidia.com/gpu.present")) }}
{{- range $c := $checks }}
{{- $what := index $c 0 }}{{ $name := index $c 1 }}
{{- if has $name (index $c 2) }}
{{- fail (printf "%s %s is not gpu-ready's: the admission policy would let gpu-ready's token change it" $what $name) }}
{{- end }}
{{- if and (regexMatch $reserved $name) (not (and (eq $what "taints.key") (regexMatch $ownTaint $name))) }}
{{- fail (printf "%s %s is under a prefix reserved for Kubernetes (kubernetes.io, k8s.io): the admission policy would let gpu-ready's token change it" $what $name) }}
{{- end }}
{{- end }}
{{- /* Names other components own (docs/deployment.md "Names gpu-ready refuses", with sources): the admission
       policies exempt gpu-ready's names for its tokens, so one of these would hand another component's state to
       them. Node Problem Detector's condition types (its config/*.json: kernel-monitor, docker-monitor,
       systemd-monitor, health-checker-*); Karpenter's (karpenter.sh/, karpenter.k8s.aws/) and Cilium's
       (node.cilium.io/) taints and labels; the GPU Operator's and GPU feature discovery's labels (nvidia.com/gpu.*,
       nvidia.com/mig.*, nvidia.com/cuda.*, nvidia.com/gfd.*, nvidia.com/vgpu.*); the clouds' node labels. */}}
{{- $npd := list "KernelDeadlock" "ReadonlyFilesystem" "CorruptDockerOverlay2" "FrequentKubeletRestart" "FrequentDockerRestart" "FrequentContainerdRestart" "FrequentUnregisterNetDevice" "KubeletUnhealthy" "ContainerRuntimeUnhealthy" }}
{{- if has .Values.conditionType $npd }}
{{- fail (printf "conditionType %s is Node Problem Detector's condition: the admission policy would let gpu-ready's token change it" .Values.conditionType) }}
{{- end }}
{{- $others := `^(karpenter\.sh|karpenter\.k8s\.aws|node\.cilium\.io|eks\.amazonaws\.com|cloud\.google\.com|kubernetes\.azure\.com)/|^nvidia\.com/(gpu|mig|cuda|gfd|vgpu)\.` }}
{{- range $c := list (list "conditionType" $.Values.conditionType) (list "taints.key" $.Values.taints.key) (list "config.preflightLabel" (toString $.Values.config.preflightLabel)) (list "preflight.needsLabel" $.Values.preflight.needsLabel) }}
{{- if regexMatch $others (index $c 1) }}
{{- fail (printf "%s %s is another component's name (Karpenter, Cilium, the GPU Operator, a cloud provider): the admission policy would let gpu-ready's token change it" (index $c 0) (index $c 1)) }}
{{- end }}
{{- end }}
{{- with .Values.recovery }}
{{- if and .enabled .evict (not $.Values.nodeRestriction.enabled) }}
{{- fail "recovery.evict needs nodeRestriction.enabled: without the admission policy the agent's token could delete any pod in the cluster" }}
{{- end }}
{{- $dp := .devicePlugin | default dict }}
{{- if and .enabled $dp.daemonSet (not (regexMatch `(nvidia|gpu|device-plugin)` $dp.daemonSet)) }}
{{- fail (printf "recovery.devicePlugin.daemonSet %s is not a GPU device plugin (its name has none of nvidia, gpu, device-plugin): the agent's token could delete that DaemonSet's pod on its node" $dp.daemonSet) }}
{{- end }}
{{- end }}
{{- if eq (toString .Values.config.preflightLabel) .Values.preflight.needsLabel }}
{{- fail (printf "config.preflightLabel and preflight.needsLabel are both %s: they must differ" .Values.preflight.needsLabel) }}
{{- end }}
{{- end -}}

{{- /* The label that makes a Node one of the chart's GPU nodes (the controller's --gpu-selector, the DaemonSet's
       affinity): the controller's Jobs and preflight's cordon are held to Nodes carrying it set to "true". */ -}}
{{- define "gpu-ready.gpuLabelKey" -}}nvidia.com/gpu.present{{- end -}}
