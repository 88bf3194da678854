# Prometheus from Debian's package, on the same Debian base as roseserve's image (no
# registry needed: `docker compose --profile monitoring build`).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && \
    rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=0.0.0.0:9090"]
