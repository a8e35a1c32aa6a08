#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole suite.
source "$(dirname "$0")/env.sh"
# The operations tests check the systemd unit with systemd-analyze and the
# Prometheus config/rules with promtool (and scrape a daemon with a real
# Prometheus); the console's tests drive chromium with Playwright.  Debian
# packages them; under CI=true they are required.
if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null \
    && { ! command -v systemd-analyze >/dev/null || ! command -v promtool >/dev/null || ! command -v chromium >/dev/null; }; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "==> installing systemd, prometheus and chromium (systemd-analyze, promtool, the console's browser)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends systemd prometheus chromium >/dev/null
fi
# Two worker processes, a test file each at a time (a file's daemons and module fixtures stay in
# one process): many tests wait on daemons, links and timeouts rather than the CPU, so two run in
# about two thirds of the time one does, even on 2 cores.  SPECD_TEST_WORKERS=0 runs in this process.
set +e
python -m pytest -n "${SPECD_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "ops/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
