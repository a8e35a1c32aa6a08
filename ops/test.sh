#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole suite.
source "$(dirname "$0")/env.sh"
# The operations tests check the systemd unit with systemd-analyze and the
# Prometheus config/rules with promtool (and scrape a daemon with a real
# Prometheus).  Debian packages them; under CI=true they are required.
if [ "$(uname -s)" = Linux ] && { ! command -v systemd-analyze >/dev/null || ! command -v promtool >/dev/null; } \
    && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "==> installing systemd and prometheus (systemd-analyze, promtool)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends systemd prometheus >/dev/null
fi
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "ops/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
