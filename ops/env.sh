# Sourced by the ops scripts (and by hand before a benchmark): a venv with specd
# installed, and on Linux the OpenBLAS preload that makes MLX's CPU float32
# matmuls ~40x faster.  Sourced into an interactive shell, it gives the shell
# its own options back, so a later failing command does not close it.
_specd_shell_options=$(set +o)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECD_VENV:-$ROOT/.venv}"
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3

if [ "$(uname -s)" = Linux ] && [ ! -e "$OPENBLAS" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "==> installing libopenblas0-pthread (Debian/Ubuntu)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import specd, openai, pytest" 2>/dev/null \
    || [ "$ROOT/pyproject.toml" -nt "$VENV/.specd-installed" ]; then
  echo "==> installing specd and its test and vision dependencies"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e "$ROOT[test,vision]"
  touch "$VENV/.specd-installed"
fi
if [ -e "$OPENBLAS" ]; then
  export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
  # Its idle worker threads sleep within 2^4 cycles rather than spin for 2^28 on the cores
  # MLX's CPU streams attend on (specd/core/kv.py); the specd service sets the same.
  export OPENBLAS_THREAD_TIMEOUT="${OPENBLAS_THREAD_TIMEOUT:-4}"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
if [[ $- == *i* ]]; then
  eval "$_specd_shell_options"
fi
unset _specd_shell_options
