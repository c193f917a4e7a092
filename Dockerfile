# The project image that cluster/rayservice.yaml runs (head and workers), built from the
# repository root:
#
#   docker build -t trt-serve:0.1.0 .
#   docker build -t trt-serve:0.1.0-trt --build-arg TENSORRT=1 .   # + full TensorRT for GPU plans
#
# then push it to a registry your Kubernetes nodes pull from and put that name in
# cluster/rayservice.yaml's `image:` fields. The base is the Ray GPU image of the Ray version
# pyproject.toml pins (ray[serve]==2.60.0) with the Python it supports; the steps are
# `make models`' after an install: the package into the image's Python, then the model files
# into /app/engines (fetched from the rapidocr-onnxruntime wheel on PyPI, the CNNs generated).
# cluster/cluster.yaml runs the same two steps on each node of the Ray cluster launcher.
FROM rayproject/ray:2.60.0-py311-gpu

USER root
RUN mkdir -p /app && chown ray:users /app
USER ray
WORKDIR /app

COPY --chown=ray:users . /app
RUN pip install --no-cache-dir /app
RUN python -m deployments.runtime.tools.prepare --root /app/engines

# TensorRT plans are bound to the GPU type, so they are built on it (`make engines` on a worker
# of that type, or an image derived from this one built there). Without a fresh plan a model
# serves its ONNX file with ONNX Runtime.
ARG TENSORRT=0
RUN if [ "$TENSORRT" = 1 ]; then pip install --no-cache-dir tensorrt-cu12 'cuda-bindings>=12.8,<13'; fi
