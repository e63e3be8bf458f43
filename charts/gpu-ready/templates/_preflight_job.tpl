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
  template:
    metadata:
      labels:
        {{- include "gpu-ready.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: preflight
    spec:
      restartPolicy: Never
      serviceAccountName: {{ $name }}
      # No token in the pod by default: only the cordon and record steps mount one (volume api-token).
      automountServiceAccountToken: false
      # Never shareProcessNamespace: the gates container could then read the token through /proc/<pid>/root.
      shareProcessNamespace: false
      enableServiceLinks: false
      {{- if $v.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
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
        {{- toYaml . | nindent 8 }}
        {{- end }}
        - name: profile
          configMap:
            name: {{ $name }}-profile
        - name: tmp
          emptyDir: {}
        - name: results
          emptyDir:
            sizeLimit: 1Mi
        - name: api-token
          projected:
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
                        fieldPath: metadata.namespace
{{- end -}}

{{- /* The preflight Job's signature: what the controller's admission policy compares a Job it creates with
       (controller-policy.yaml). One string per init container, container and volume, and one for the pod and
       the Job, from the same rendering the controller's ConfigMap holds; the policy's CEL builds the same strings
       from the Job sent. Renders YAML: {init: [...], main: [...], volumes: [...], pod: "...", job: "..."}. */ -}}
{{- define "gpu-ready.preflight.signature" -}}
{{- $job := fromYaml (include "gpu-ready.preflight.job" (dict "root" . "nodeName" "gpu-ready-controller-pins-this")) -}}
{{- $spec := $job.spec.template.spec -}}
{{- $out := dict "init" list "main" list "volumes" list -}}
{{- range $kind := list "init" "main" -}}
{{- $cs := ternary $spec.initContainers $spec.containers (eq $kind "init") -}}
{{- $sigs := list -}}
{{- range $c := $cs -}}
{{- $env := list -}}
{{- range $e := (default list $c.env) -}}
{{- $val := toString (default "" $e.value) -}}
{{- if $e.valueFrom }}{{ $val = ternary (printf "field:%s" (($e.valueFrom.fieldRef | default dict).fieldPath | default "")) "from" (hasKey $e.valueFrom "fieldRef") }}{{ end -}}
{{- $env = append $env (printf "%s=%s" $e.name $val) -}}
{{- end -}}
{{- $mounts := list -}}
{{- range $m := (default list $c.volumeMounts) -}}
{{- $mounts = append $mounts (printf "%s:%s:%s" $m.name $m.mountPath (toString (and (hasKey $m "readOnly") $m.readOnly))) -}}
{{- end -}}
{{- $sc := default dict $c.securityContext -}}
{{- $ape := true }}{{ if hasKey $sc "allowPrivilegeEscalation" }}{{ $ape = $sc.allowPrivilegeEscalation }}{{ end -}}
{{- $ru := "-1" }}{{ if hasKey $sc "runAsUser" }}{{ $ru = toString (int64 $sc.runAsUser) }}{{ end -}}
{{- $add := (default dict $sc.capabilities).add | default list -}}
{{- $sec := printf "%s:%s:%s:%s" (toString (and (hasKey $sc "privileged") $sc.privileged)) (toString $ape) $ru (join "," $add) -}}
{{- $hooks := printf "%s:%s:%s:%s:%s" (toString (hasKey $c "lifecycle")) (toString (hasKey $c "livenessProbe")) (toString (hasKey $c "readinessProbe")) (toString (hasKey $c "startupProbe")) (default "" $c.workingDir) -}}
{{- $sig := printf "%s|%s|%s|%s|%s|%d|%s|%s|%s" $c.name $c.image (join " " (default list $c.command)) (join " " (default list $c.args)) (join "," $env) (len (default list $c.envFrom)) (join "," $mounts) $sec $hooks -}}
{{- $sigs = append $sigs $sig -}}
{{- end -}}
{{- $_ := set $out $kind $sigs -}}
{{- end -}}
{{- $vols := list -}}
{{- range $v := $spec.volumes -}}
{{- $what := "other" -}}
{{- if hasKey $v "hostPath" }}{{ $what = printf "hostPath=%s" $v.hostPath.path }}
{{- else if hasKey $v "secret" }}{{ $what = printf "secret=%s" $v.secret.secretName }}
{{- else if hasKey $v "configMap" }}{{ $what = printf "configMap=%s" $v.configMap.name }}
{{- else if hasKey $v "emptyDir" }}{{ $what = "emptyDir" }}
{{- else if hasKey $v "projected" }}
{{- $srcs := list -}}
{{- range $s := $v.projected.sources -}}
{{- if hasKey $s "serviceAccountToken" }}{{ $srcs = append $srcs (printf "token:%s:%s" $s.serviceAccountToken.path (default "" $s.serviceAccountToken.audience)) }}
{{- else if hasKey $s "configMap" }}{{ $srcs = append $srcs (printf "configMap:%s" $s.configMap.name) }}
{{- else if hasKey $s "secret" }}{{ $srcs = append $srcs (printf "secret:%s" $s.secret.name) }}
{{- else if hasKey $s "downwardAPI" }}{{ $srcs = append $srcs "downwardAPI" }}
{{- else }}{{ $srcs = append $srcs "other" }}{{ end -}}
{{- end -}}
{{- $what = printf "projected=%s" (join "," $srcs) -}}
{{- end -}}
{{- $vols = append $vols (printf "%s:%s" $v.name $what) -}}
{{- end -}}
{{- $_ := set $out "volumes" $vols -}}
{{- $psc := default dict $spec.securityContext -}}
{{- $pru := "-1" }}{{ if hasKey $psc "runAsUser" }}{{ $pru = toString (int64 $psc.runAsUser) }}{{ end -}}
{{- $tols := list -}}
{{- range $t := (default list $spec.tolerations) }}{{ $tols = append $tols (printf "%s:%s:%s" (default "" $t.key) (default "" $t.operator) (default "" $t.effect)) }}{{ end -}}
{{- $pod := printf "%s|%s|%s|%s|%s|%s|%s|%s|%s" $spec.serviceAccountName (toString (and (hasKey $spec "automountServiceAccountToken") $spec.automountServiceAccountToken)) (toString (and (hasKey $spec "hostNetwork") $spec.hostNetwork)) (toString (and (hasKey $spec "hostPID") $spec.hostPID)) (toString (and (hasKey $spec "hostIPC") $spec.hostIPC)) (toString (and (hasKey $spec "shareProcessNamespace") $spec.shareProcessNamespace)) (default "" $spec.runtimeClassName) $pru (join "," $tols) -}}
{{- $_ := set $out "pod" $pod -}}
{{- $_ := set $out "job" (printf "%s|%s" (toString (int64 $job.spec.backoffLimit)) (toString (int64 $job.spec.activeDeadlineSeconds))) -}}
{{- toYaml $out -}}
{{- end -}}
