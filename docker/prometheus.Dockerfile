# Prometheus from Debian's `prometheus` package, configured to scrape the compose cluster.
#
# Same base as the broker image (see docker/Dockerfile); built by scripts/docker-build.sh, whose
# build context holds docker/prometheus.yml, dashboards/prometheus/alerts.yml and the console
# pages of dashboards/consoles/. The package comes from the Debian mirror of the base's apt
# sources. It ships the console libraries (prom.lib, menu.lib), which the pages need, as an
# example under /usr/share/doc; the slim Debian images exclude /usr/share/doc from every
# package (/etc/dpkg/dpkg.cfg.d/docker), so that directory is included again.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
LABEL org.bmq.image="prometheus"

# policy-rc.d stops the package's maintainer scripts from trying to start a service during
# the build; no init system runs in the container.
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d \
    && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        -o Dpkg::Options::=--path-include=/usr/share/doc/prometheus/examples/console_libraries/* \
        prometheus \
    && test -f /usr/share/doc/prometheus/examples/console_libraries/prom.lib \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/sbin/policy-rc.d \
    && mkdir -p /var/lib/prometheus/metrics2 \
    && chown -R prometheus:prometheus /var/lib/prometheus

COPY prometheus.yml /etc/prometheus/prometheus.yml
COPY alerts.yml /etc/prometheus/rules/bmq.yml
COPY consoles/ /etc/prometheus/consoles/

USER prometheus
VOLUME ["/var/lib/prometheus"]
EXPOSE 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["/usr/bin/promtool", "query", "instant", "http://127.0.0.1:9090", "vector(1)"]

ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", \
     "--storage.tsdb.path=/var/lib/prometheus/metrics2", \
     "--web.listen-address=:9090", \
     "--web.console.libraries=/usr/share/doc/prometheus/examples/console_libraries", \
     "--web.console.templates=/etc/prometheus/consoles"]
