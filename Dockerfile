# Encoder server image: a CUDA build of torch from the PyTorch base image, the project on top.
#   docker build -t encoder-service:0.1.0 .
#   docker run --gpus 1 -p 50051:50051 -p 9000:9000 -v /path/to/checkpoints:/models:ro \
#     -e ENCODER_MODEL=/models/Qwen2.5-VL-7B-Instruct encoder-service:0.1.0
# Every encoder-server flag can be given as arguments or as its ENCODER_* environment variable.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

# glibc would mmap (and page-fault) every fresh buffer of 32 MiB or more; large embedding
# gRPC payloads moved 1.3-3x faster with these thresholds (measured). Read by glibc at start-up.
ENV MALLOC_MMAP_THRESHOLD_=1073741824 \
    MALLOC_TRIM_THRESHOLD_=2147483648 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    ENCODER_HOST=0.0.0.0 \
    ENCODER_PORT=50051 \
    ENCODER_METRICS_PORT=9000

WORKDIR /opt/encoder-service
# The generated protobuf code is committed in protos/: nothing is generated at build time.
COPY pyproject.toml ./
COPY protos ./protos
COPY encoder_common ./encoder_common
COPY encoder_server ./encoder_server
COPY precompute ./precompute
COPY receiver ./receiver
# libibverbs1: the Mooncake transfer engine (--mooncake-transfer) loads it, for TCP as for RDMA.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
# The server extra: the model stack. The base image's CUDA torch and torchvision (the processors'
# torchvision backend, which runs preprocessing on the GPU) satisfy those requirements, so pip keeps them.
# The store extra: the client of the fleet-wide embedding store (--store-url); the mooncake extra: the
# transfer engine; the tracing extra: spans exported over OTLP once ENCODER_OTLP_TRACES_ENDPOINT names a
# collector.
RUN pip install --no-cache-dir "./[server,store,mooncake,tracing]" \
    && python -c "import torch, torchvision, protos.encoder_pb2, encoder_server.server, receiver, mooncake.engine" \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin encoder

USER 10001
# Mount checkpoints here (read-only is enough) and point ENCODER_MODEL at one of them.
VOLUME ["/models"]
EXPOSE 50051 9000
ENTRYPOINT ["encoder-server"]
