# `make serve` and `make test` do all the set-up on a fresh machine (Python 3.10+ with venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= test,bench,tensorrt

.PHONY: serve test unit integration models engines plan venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	# Type stubs for the TensorRT adapter's mypy check; --no-deps because they pin `tensorrt`,
	# which PyPI only serves from NVIDIA's own index.
	$(PY) -m pip install --quiet --no-deps tensorrt-stubs==10.13.0.35.1
	touch $(STAMP)

# Fetch the OCR models from the rapidocr-onnxruntime wheel and generate the CNNs into engines/.
models: $(STAMP)
	$(PY) -m deployments.prepare --root engines

# Serve every model in engines/ on 127.0.0.1:8000 (KServe v2 REST).
serve: models
	$(VENV)/bin/serve run serve_config.yaml

# Build a TensorRT plan for every model (TensorRT, or TensorRT-RTX on a CPU-only machine).
engines: models
	$(PY) -m deployments.runtime.build --root engines

# Per model: parameters, engine and context bytes (predicted and measured), fit on a GPU.
plan: models
	$(PY) -m deployments.runtime.memory plan --root engines --measure

test: models
	$(PY) -m pytest tests

unit: models
	$(PY) -m pytest tests/unit

integration: models
	$(PY) -m pytest tests/integration

clean:
	rm -rf $(VENV) engines/.cache engines/*/[0-9]*/
