#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole suite.
source "$(dirname "$0")/env.sh"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "ops/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
