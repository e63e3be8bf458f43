{{- /* The preflight Job, the one template: preflight.yaml renders it for one node (preflight.nodeName) or any
       node labelled needsLabel=true; controller.yaml renders it into the controller's ConfigMap with the node
       left for the controller to pin (nodeName), and the controller's admission policy compares the Jobs it
       creates with it. Arguments: root (the chart's context) and nodeName. */ -}}
{{- define "gpu-ready.preflight.job" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $nodeName := .nodeName -}}
{{- $name := include "gpu-ready.preflightName" $root -}}
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ printf "%s-%s" $name (default "next" $nodeName) | trunc 63 | trimSuffix "-" }}
  namespace: {{ $root.Release.Namespace }}
  labels: {{- include "gpu-ready.labels" $root | nindent 4 }}
spec:
  backoffLimit: 0
  activeDeadlineSeconds: 7200
  ttlSecondsAfterFinished: 86400
  # What the apiserver would default, stated: the controller's admission policy compares the Job it creates with
  # this rendering exactly, as the apiserver has it after defaulting (controller-policy.yaml).
  completions: 1
  parallelism: 1
  completionMode: NonIndexed
  suspend: false
  manualSelector: false
  podReplacementPolicy: TerminatingOrFailed
  template:
    metadata:
      labels:
        {{- include "gpu-ready.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: preflight
    spec:
      restartPolicy: Never
      # The pod's own deadline puts its pods in the Terminating quota scope: the ResourceQuota of
      # templates/resourcequota.yaml counts running preflight pods (no other pod of the chart has one).
      activeDeadlineSeconds: 7200
      terminationGracePeriodSeconds: 30
      schedulerName: default-scheduler
      serviceAccountName: {{ $name }}
      serviceAccount: {{ $name }}
      # No token in the pod by default: only the cordon and record steps mount one (volume api-token).
      automountServiceAccountToken: false
      # Never shareProcessNamespace: the gates container could then read the token through /proc/<pid>/root.
      shareProcessNamespace: false
      enableServiceLinks: false
      {{- if $v.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- else }}
      dnsPolicy: ClusterFirst
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- if $nodeName }}
      nodeName: {{ $nodeName }}   # bypasses the scheduler: runs on the cordoned node
      {{- else }}
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions:
                  - key: {{ $v.preflight.needsLabel }}
                    operator: In
                    values: ["true"]
      {{- end }}
      tolerations:
        - key: node.kubernetes.io/unschedulable
          operator: Exists
          effect: NoSchedule
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
        - key: {{ $v.taints.key }}
          operator: Exists
      securityContext:
        seccompProfile:
          type: RuntimeDefault
        runAsNonRoot: true
        runAsUser: 65532
      # Steps run in order: cordon (token) -> gates (no token, GPUs) -> record (token). The gates step always
      # exits 0 once it has written its results; a gates container that dies leaves the node cordoned.
      initContainers:
        - name: cordon
          {{- include "gpu-ready.preflight.container" (dict "root" $root "step" "cordon") | nindent 10 }}
            - name: api-token
              mountPath: /var/run/secrets/kubernetes.io/serviceaccount
              readOnly: true
        - name: gates
          {{- include "gpu-ready.preflight.container" (dict "root" $root "step" "gates") | nindent 10 }}
            - name: results
              mountPath: /results
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      containers:
        - name: record
          {{- include "gpu-ready.preflight.container" (dict "root" $root "step" "record") | nindent 10 }}
            - name: results
              mountPath: /results
              readOnly: true
            - name: api-token
              mountPath: /var/run/secrets/kubernetes.io/serviceaccount
              readOnly: true
      volumes:
        {{- with $v.extraVolumes }}
        {{- include "gpu-ready.preflight.defaultedVolumes" . | nindent 8 }}
        {{- end }}
        - name: profile
          configMap:
            name: {{ $name }}-profile
            defaultMode: 420
        - name: tmp
          emptyDir: {}
        - name: results
          emptyDir:
            sizeLimit: 1Mi
        - name: api-token
          projected:
            defaultMode: 420
            sources:
              - serviceAccountToken:
                  path: token
                  expirationSeconds: 3600
              - configMap:
                  name: kube-root-ca.crt
                  items:
                    - key: ca.crt
                      path: ca.crt
              - downwardAPI:
                  items:
                    - path: namespace
                      fieldRef:
                        apiVersion: v1
                        fieldPath: metadata.namespace
{{- end -}}


{{- /* The preflight Job as the controller's admission policy expects it: a CEL literal of the whole Job spec, as the
       apiserver has it after defaulting (the template states every default, so the rendering is that shape), with
       what the apiserver adds at create (the selector and the pod labels naming the Job, from the object's uid
       and name), the node (variables.node) and the pod template's metadata (checked apart, in the policy). The
       policy compares it with `==` on the object: one whole-object comparison, no field joined into a string, so
       a field the template does not set (a priority class, a sidecar, a sysctl...) is a difference like any
       other. */ -}}
{{- define "gpu-ready.preflight.expectedSpec" -}}
{{- $job := fromYaml (include "gpu-ready.preflight.job" (dict "root" . "nodeName" "__GPU_READY_NODE__")) -}}
{{- $spec := $job.spec -}}
{{- $_ := set $spec "selector" (dict "matchLabels" (dict "batch.kubernetes.io/controller-uid" "__GPU_READY_UID__")) -}}
{{- $_ := set $spec.template "metadata" "__GPU_READY_TEMPLATE_METADATA__" -}}
{{- include "gpu-ready.cel.literal" $spec | replace "\"__GPU_READY_NODE__\"" "variables.node" | replace "\"__GPU_READY_UID__\"" "object.metadata.uid" | replace "\"__GPU_READY_TEMPLATE_METADATA__\"" "object.spec.template.metadata" -}}
{{- end -}}

{{- /* The pod template's labels as the apiserver stores them: the template's, and the four the Job's create adds. */ -}}
{{- define "gpu-ready.preflight.expectedPodLabels" -}}
{{- $job := fromYaml (include "gpu-ready.preflight.job" (dict "root" . "nodeName" "x")) -}}
{{- $l := deepCopy $job.spec.template.metadata.labels -}}
{{- $_ := set $l "batch.kubernetes.io/controller-uid" "__GPU_READY_UID__" -}}
{{- $_ := set $l "controller-uid" "__GPU_READY_UID__" -}}
{{- $_ := set $l "batch.kubernetes.io/job-name" "__GPU_READY_NAME__" -}}
{{- $_ := set $l "job-name" "__GPU_READY_NAME__" -}}
{{- include "gpu-ready.cel.literal" $l | replace "\"__GPU_READY_UID__\"" "object.metadata.uid" | replace "\"__GPU_READY_NAME__\"" "object.metadata.name" -}}
{{- end -}}

{{- /* The Job's own labels as the controller sends them: the template's and its three bookkeeping labels (their
       values are the controller's: checked by form in the policy). */ -}}
{{- define "gpu-ready.preflight.expectedJobLabels" -}}
{{- $job := fromYaml (include "gpu-ready.preflight.job" (dict "root" . "nodeName" "x")) -}}
{{- $l := deepCopy $job.metadata.labels -}}
{{- $_ := set $l "gpu-ready.io/managed-by" "gpu-ready-controller" -}}
{{- $_ := set $l "gpu-ready.io/preflight-node" "__GPU_READY_NODE_LABEL__" -}}
{{- $_ := set $l "gpu-ready.io/preflight-attempt" "__GPU_READY_ATTEMPT__" -}}
{{- include "gpu-ready.cel.literal" $l | replace "\"__GPU_READY_NODE_LABEL__\"" "object.metadata.labels[?\"gpu-ready.io/preflight-node\"].orValue(\"\")" | replace "\"__GPU_READY_ATTEMPT__\"" "object.metadata.labels[?\"gpu-ready.io/preflight-attempt\"].orValue(\"\")" -}}
{{- end -}}


{{- /* A value as a CEL literal the apiserver's type checker takes: its literals must be homogeneous, so every map
       value and list element is wrapped in dyn(); strings, numbers and booleans as JSON writes them. */ -}}
{{- define "gpu-ready.cel.literal" -}}
{{- if kindIs "map" . -}}
{{- $v := . -}}
{ {{- range $i, $k := keys $v | sortAlpha }}{{ if $i }}, {{ end }}{{ toJson $k }}: dyn({{ include "gpu-ready.cel.literal" (get $v $k) }}){{ end -}} }
{{- else if kindIs "slice" . -}}
[ {{- range $i, $e := . }}{{ if $i }}, {{ end }}dyn({{ include "gpu-ready.cel.literal" $e }}){{ end -}} ]
{{- else -}}
{{- toJson . -}}
{{- end -}}
{{- end -}}


{{- /* extraVolumes as the apiserver stores them (what it defaults, stated, so the controller's policy can compare
       the Job exactly): hostPath's type "", a configMap's, secret's, projected or downwardAPI volume's
       defaultMode 420, a downwardAPI fieldRef's apiVersion v1. */ -}}
{{- define "gpu-ready.preflight.defaultedVolumes" -}}
{{- $out := list -}}
{{- range $vol := . -}}
{{- $v := deepCopy $vol -}}
{{- if and (hasKey $v "hostPath") (not (hasKey $v.hostPath "type")) }}{{ $_ := set $v.hostPath "type" "" }}{{ end -}}
{{- range $k := list "configMap" "secret" "projected" "downwardAPI" -}}
{{- if and (hasKey $v $k) (kindIs "map" (get $v $k)) (not (hasKey (get $v $k) "defaultMode")) }}{{ $_ := set (get $v $k) "defaultMode" 420 }}{{ end -}}
{{- end -}}
{{- if hasKey $v "downwardAPI" -}}
{{- range $it := ($v.downwardAPI.items | default list) -}}
{{- if and (hasKey $it "fieldRef") (not (hasKey $it.fieldRef "apiVersion")) }}{{ $_ := set $it.fieldRef "apiVersion" "v1" }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $out = append $out $v -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
