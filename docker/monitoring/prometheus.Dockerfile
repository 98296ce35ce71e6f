# Prometheus for compose.yaml's `monitoring` profile, from Debian's package (no image
# registry needed): scripts/images prometheus. Config: docker/monitoring/prometheus.yml.
ARG BASE_IMAGE=aegaeon-base:bookworm
FROM ${BASE_IMAGE}
ARG PROMETHEUS_VERSION=2.42.0+ds-5+deb12u1
# policy-rc.d: the package's scripts start no daemon during the build; the raw time zone
# data of moment-timezone (212 MB) is never read by the web UI
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
 && echo 'path-exclude /usr/share/javascript/moment-timezone/data/*' \
      > /etc/dpkg/dpkg.cfg.d/aegaeon-slim \
 && apt-get update -q \
 && apt-get install -y -q --no-install-recommends "prometheus=${PROMETHEUS_VERSION}" wget \
 && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
 && install -d -o prometheus -g prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s \
  CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:9090/-/healthy"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
