// Package crdgen pins the tools that generate the prometheus-operator CRDs (ServiceMonitor,
// PrometheusRule) from their Go API types, so that the chart's optional objects can be checked by a
// real server-side dry-run. Run by tools/k8s-testbin/build.sh; nothing here is imported.
package crdgen

import _ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
