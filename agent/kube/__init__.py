"""The Kubernetes wing: the API client, one watch thread, the Node and slice caches, backoff, and kubelet's
gRPC transport. It knows nothing about GPUs."""
