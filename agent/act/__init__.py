"""The action wing: everything that changes the cluster or a GPU (the own Node's taint, per-GPU
DeviceTaintRules). Each action is behind a setting and bounded three ways: in code, by the admission policy
and by the fleet brake."""
