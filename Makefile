# gpu-ready developer entry points. On a fresh machine: `make demo` or `make test` (each sets itself up).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: dev testbin test test-oldest e2e test-fast lint demo bench chart-lint chart-readme deploy clean gpu-smoke protos docs lock release-dry-run

# The runtime set at the versions requirements/runtime.lock pins (what the image installs), as plain constraints.
$(STAMP): pyproject.toml requirements/runtime.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	sed -n -E 's/^([A-Za-z0-9][A-Za-z0-9._-]*==[^ ;\\]+).*/\1/p' requirements/runtime.lock >$(VENV)/runtime-constraints.txt
	$(BIN)/pip install -q -e '.[dev]' -c $(VENV)/runtime-constraints.txt
	touch $(STAMP)

## dev: create .venv and install gpu-ready with its development dependencies
dev: $(STAMP)

## testbin: build (once, then cached) kube-apiserver, etcd, helm; extract promtool/prometheus
testbin:
	tools/k8s-testbin/build.sh >/dev/null

## test: every test, against the real kube-apiserver + etcd, the real-node tests (make e2e) included, then the
##   admission-policy matrix and the agent's end-to-end tests again on the oldest claimed minor (make test-oldest)
test: dev testbin
	tools/containerd/build.sh >/dev/null
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-oldest

## test-oldest: the admission-policy matrix and the agent's end-to-end tests on kube-apiserver at the oldest minor the
##   chart claims (K8S_OLDEST_VERSION in tools/k8s-testbin/versions.env; built once, then cached); part of make test
OLDEST_TESTS := tests/test_security.py tests/test_security_bounds.py tests/test_agent_e2e.py tests/test_uninstall.py
test-oldest: dev testbin
	GPU_READY_TESTBIN_DIR=$$(tools/k8s-testbin/build.sh oldest) $(BIN)/python -m pytest -q -rs $(OLDEST_TESTS)

## e2e: only the real-node tests: the chart on kubelet + containerd with the image built from docker/Dockerfile
##   (root; Debian packages as .ci/run installs them; containerd and the images are built and cached on first use)
e2e: dev testbin
	tools/containerd/build.sh >/dev/null
	$(BIN)/python -m pytest -q -m node

## test-fast: only the tests that need no apiserver
test-fast: dev
	$(BIN)/python -m pytest -q -m "not apiserver"

## lint: ruff (check + format), mypy, import-linter (module boundaries)
lint: dev
	$(BIN)/ruff check agent tests bench testkit tools/release tools/chart_readme.py tools/deploy_manifests.py
	$(BIN)/ruff format --check agent tests bench testkit tools/release tools/chart_readme.py tools/deploy_manifests.py
	$(BIN)/mypy
	$(BIN)/lint-imports

## demo: local control plane + simulated GPU node + the real agent: healthy -> ERR! -> Xid 79 -> clear
demo: dev
	tools/k8s-testbin/build.sh demo >/dev/null
	$(BIN)/python -m testkit.demo

## gpu-smoke: on a machine with NVIDIA GPUs, capture nvidia-smi and run check + preflight into one folder
##   (no GPUs: prints "no NVIDIA GPU here", exit 0); needs no network, uses .venv when it is there
gpu-smoke:
	PY=$(if $(wildcard $(BIN)/python),$(abspath $(BIN)/python),$(PY)) tools/gpu-smoke.sh

## protos: regenerate agent/proto/podresources_v1_pb2.py(i) from the vendored kubelet proto (committed; a test
##   checks the committed files are what this makes)
protos: dev
	cd agent/proto && ../../$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. podresources_v1.proto
	# the test device plugin's stubs (testkit/deviceplugin.py; grpcio server, tests only), from the repository root
	# so that the generated *_pb2_grpc.py imports `from testkit.proto import ...`
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		testkit/proto/deviceplugin_v1beta1.proto

## docs: write docs/configuration.md's settings table from the settings rows and docs/corpus.md's coverage table
##   from the node bundles (tests check both are current)
docs: dev
	$(BIN)/python -c "from agent.config import write_settings_table as w; w('docs/configuration.md')"
	$(BIN)/python -m testkit.corpus

## chart-readme: write charts/gpu-ready/README.md from the chart's values.schema.json, values.yaml and examples/
##   (a test checks it is current)
chart-readme: dev
	$(BIN)/python tools/chart_readme.py

## deploy: write deploy/ from the chart: gpu-ready.yaml for `kubectl apply -f` (helm template, default values, no
##   hooks) and the rules and dashboard files (a test checks deploy/ is current)
deploy: dev testbin
	$(BIN)/python tools/deploy_manifests.py --helm "$$(tools/k8s-testbin/build.sh)/helm"

## lock: re-resolve requirements/runtime.lock (the image's runtime set, pinned and hashed) after a dependency change
lock:
	tools/release/lock.sh

## release-dry-run: the release workflow's steps here, pushing nothing: the image (registry-free build), its digest,
##   the chart packaged for RELEASE_VERSION (default agent.__version__) and rendered by digest, the SBOM checked
##   against the lock, the light client path on in the image (root; what `make e2e` needs). docs/release.md
release-dry-run: dev testbin
	tools/release/dry-run.sh $(RELEASE_VERSION)

## bench: the benchmarks in bench/, one summary table
bench: dev testbin
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
