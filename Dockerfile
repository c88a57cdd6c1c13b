# syntax=docker/dockerfile:1
# The ddiloco image: learners, synchronizers, evaluators, Prefect workers and their flow runs.
#   docker build --target cpu  -t ddiloco:cpu  .     # control plane and CPU regions (CPU torch)
#   docker build --target cuda -t ddiloco:cuda .     # GPU learners (torch's CUDA build)
# Both carry what any run of the shipped configs needs (EXTRAS): flows (Prefect), s3 and gcs stores, the postgres ledger
# driver, hf (model.kind hf, data.source text/hf/tokens with a tokenizer) and tensorboard (the evaluator's series).
# Other sets are a build argument away:
#   docker build --target cuda --build-arg EXTRAS=flows,s3,gcs,postgres,hf,tensorboard,titan -t ddiloco:cuda-titan .
#   docker build --target cpu  --build-arg EXTRAS=ui,postgres,s3 -t ddiloco:ui .      # the dashboard
# torch is the version constraints.txt pins, so the image runs the code the tests ran.

ARG EXTRAS=flows,s3,gcs,postgres,hf,tensorboard

FROM python:3.11-slim AS cpu
ARG EXTRAS
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 STREAMLIT_BROWSER_GATHER_USAGE_STATS=false \
    PREFECT_LOGGING_EXTRA_LOGGERS=ddiloco
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY ddiloco ./ddiloco
COPY examples ./examples
# The CPU build of torch from the PyTorch index (PyPI's Linux wheel is the multi-GB CUDA build).
RUN pip install --index-url "$TORCH_INDEX" "torch==$(sed -n 's/^torch==//p' constraints.txt)" \
 && pip install -c constraints.txt ".[${EXTRAS}]"
RUN useradd --create-home ddiloco && chown -R ddiloco /app
USER ddiloco
EXPOSE 9100
CMD ["ddiloco", "--help"]

FROM python:3.11-slim AS cuda
ARG EXTRAS
# PyPI's Linux torch is the CUDA build with CUDA's libraries as wheels (torch 2.13: CUDA 13, NVIDIA driver >= 580);
# for an older driver pass an index of an older CUDA that has the pinned version, e.g.
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128. The GPUs come from the node (nvidia.com/gpu).
ARG TORCH_INDEX=https://pypi.org/simple
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PREFECT_LOGGING_EXTRA_LOGGERS=ddiloco
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY ddiloco ./ddiloco
COPY examples ./examples
RUN pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple \
        "torch==$(sed -n 's/^torch==//p' constraints.txt)" \
 && pip install -c constraints.txt ".[${EXTRAS}]" \
 && python -c "import torch, ddiloco; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
RUN useradd --create-home ddiloco && chown -R ddiloco /app
USER ddiloco
EXPOSE 9100
CMD ["ddiloco", "--help"]
