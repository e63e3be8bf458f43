// Package containerd pins containerd 2.x (containerd, containerd-shim-runc-v2, ctr), built from Go modules
// for the real-node tests (testkit/node.py). Built by tools/containerd/build.sh; nothing here is imported.
package containerd
