"""trt-serve: a multi-model inference server on Ray Serve (KServe v2 / Open Inference Protocol).

Importing the package refuses a Python older than ``MIN_PYTHON`` with one line on stderr (exit 1):
``serve run`` imports it without going through ``make``, and the code uses 3.11's standard
library (``asyncio.timeout``, ``sys.get_int_max_str_digits``), which an older Python would only
miss at the first request (a 500 on every route that reads a body). The Makefile runs the same
check (``import deployments``) before it makes a virtual environment. ``MIN_PYTHON`` must match
pyproject.toml's ``requires-python`` (tests/unit/test_python_version.py checks both, and the code
against it with ``vermin``). This module must stay readable by old Pythons (no syntax newer than 3.6).
"""

import sys

__version__ = "0.1.0"
MIN_PYTHON = (3, 11)

if sys.version_info < MIN_PYTHON:
    sys.exit(f"trt-serve needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; this is Python "
             f"{'.'.join(map(str, sys.version_info[:3]))} ({sys.executable}). With make: "
             f"make serve PYTHON=python{'.'.join(map(str, MIN_PYTHON))} (after `make clean` if .venv exists)")
