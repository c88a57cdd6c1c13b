# syntax=docker/dockerfile:1
# The ddiloco image: learners, synchronizers, Prefect workers and their flow runs.
#   docker build --target cpu  -t ddiloco:cpu  .                      # CPU (python:3.11-slim, CPU torch)
#   docker build --target cuda -t ddiloco:cuda .                      # GPU (official PyTorch CUDA runtime image)
#   docker build --target cpu --build-arg EXTRAS=ui,postgres -t ddiloco:ui .   # the dashboard
# EXTRAS picks the role: a learner needs flows (its flow runs), s3/gcs and postgres, never ui.

ARG CUDA_BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM python:3.11-slim AS cpu
ARG EXTRAS=flows,s3,gcs,postgres
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

FROM ${CUDA_BASE} AS cuda
ARG EXTRAS=flows,s3,gcs,postgres
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PREFECT_LOGGING_EXTRA_LOGGERS=ddiloco
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY ddiloco ./ddiloco
COPY examples ./examples
# Keep the base image's CUDA torch: the constraints minus their CPU torch pin.
RUN grep -v '^torch==' constraints.txt > /tmp/constraints-cuda.txt \
 && pip install -c /tmp/constraints-cuda.txt ".[${EXTRAS}]" \
 && python -c "import torch, ddiloco; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
RUN useradd --create-home ddiloco && chown -R ddiloco /app
USER ddiloco
EXPOSE 9100
CMD ["ddiloco", "--help"]
