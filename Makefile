# `make serve` and `make test` do all the set-up on a fresh machine (Python 3.11+ with venv; an
# older one is refused with one line by `python-version`, before anything is installed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= test,bench,tensorrt
# GPU=1: ONNX Runtime's CUDA build (onnxruntime-gpu, CUDA 12/13 per its version) INSTEAD of the
# CPU one; both install the module `onnxruntime`, so never both in one environment.
GPU ?= 0
ORT_GPU ?= onnxruntime-gpu==1.31.1
ifeq ($(GPU),1)
EXTRAS := $(EXTRAS),gpu
STAMP := $(VENV)/.installed-stamp-gpu
endif

.PHONY: python-version serve check status print-serve-env bench test unit integration models engines plan venv clean

venv: $(STAMP)

# The package refuses a Python older than it needs at import (deployments/__init__.py,
# MIN_PYTHON), so importing it from here checks the interpreter: the virtual environment's once
# it exists, else $(PYTHON) before one is made. Every target that installs or runs comes here.
python-version:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -c 'import deployments'

$(STAMP): pyproject.toml | python-version
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(filter 1,$(GPU)),,$(PY) -m pip uninstall --quiet --yes onnxruntime-gpu)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	# Type stubs for the TensorRT adapter's mypy check; --no-deps because they pin `tensorrt`,
	# which PyPI only serves from NVIDIA's own index.
	$(PY) -m pip install --quiet --no-deps tensorrt-stubs==10.13.0.35.1
ifeq ($(GPU),1)
	# Swap the CPU build for the CUDA one (uninstall first: they share files of one module).
	$(PY) -m pip uninstall --quiet --yes onnxruntime onnxruntime-gpu
	$(PY) -m pip install --quiet --no-deps --force-reinstall '$(ORT_GPU)'
	$(PY) -c 'import onnxruntime as o; assert "CUDAExecutionProvider" in o.get_available_providers(), o.get_available_providers()'
endif
	rm -f $(VENV)/.installed-stamp $(VENV)/.installed-stamp-gpu
	touch $(STAMP)

# Fetch the OCR models from the rapidocr-onnxruntime wheel and generate the CNNs into engines/.
models: $(STAMP)
	$(PY) -m deployments.runtime.tools.prepare --root engines

# Ray Serve's fast paths, on unless FAST=0 (docs/placement.md, "Ray's fast paths"): the HAProxy
# ingress, Ray's throughput-optimized mode (gRPC between deployments, user code and handle
# routers on the replica's event loop), and gRPC messages up to 2 GiB (the 4 MiB default
# refuses a (1, 3, 640, 640) FP32 tensor). On a running cluster set them in its environment.
# Locally, the ingress replica need not stay reachable for 30 s after Ctrl-C so that external
# load balancers can deregister it (Serve's default drain with HAProxy; there is none here):
# DRAINING_PERIOD 0 stops in seconds; replicas still finish their requests (docs/operations.md, "Stopping").
FAST ?= 1
CONFIG ?= serve_config.yaml
FAST_ENV := RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
	RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0
# The local cluster `serve run` starts has token authentication on (Ray's default for a new
# local cluster; the token is in ~/.ray/auth_token). Ray's own tools (`serve status`,
# `ray status`, `serve shutdown`) only send the token with RAY_AUTH_MODE=token set.
RAY_ENV := RAY_AUTH_MODE=token
SERVE_ENV := $(RAY_ENV) $(if $(filter 1,$(FAST)),$(FAST_ENV))

# Serve every model in engines/ on 127.0.0.1:8000 (KServe v2 REST): `serve run serve_config.yaml`
# after checking the config and every model's config.yaml (a bad one stops there: one line
# naming file and field, exit 2), with a Ctrl-C that answers requests in flight (deployments/run.py).
serve: models
	$(SERVE_ENV) $(PY) -m deployments.run $(CONFIG)

check: models
	@$(PY) -m deployments.check $(CONFIG)

# Ray's and Serve's view of what `make serve` runs (from another terminal).
status:
	$(RAY_ENV) $(VENV)/bin/ray status
	$(RAY_ENV) $(VENV)/bin/serve status

print-serve-env:
	@echo $(SERVE_ENV)

# Ray Serve app vs the single-process baseline (bench/README.md, docs/performance.md); results in bench/results/.
bench: models
	$(PY) -m bench.throughput --quick

# Build a TensorRT plan for every model (TensorRT, or TensorRT-RTX on a CPU-only machine).
engines: models
	$(PY) -m deployments.runtime.tools.build --root engines

# Per model: parameters, engine and context bytes (predicted and measured), fit on a GPU.
plan: models
	$(PY) -m deployments.runtime.tools.plan plan --root engines --measure

test: models
	$(PY) -m pytest tests

unit: models
	$(PY) -m pytest tests/unit

integration: models
	$(PY) -m pytest tests/integration

clean:
	rm -rf $(VENV) engines/.cache engines/*/[0-9]*
