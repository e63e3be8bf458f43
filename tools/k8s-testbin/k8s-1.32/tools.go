//go:build tools

// Package tools pins the oldest Kubernetes minor the chart claims (1.32): only kube-apiserver is built from it;
// etcd and the other binaries come from the current version's module.
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
