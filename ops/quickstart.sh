#!/usr/bin/env bash
# Install specd, forge the demo model pair, start the daemon on manifests/demo and
# ask it for a chat completion.  The trained demo pair takes about 21 minutes (once:
# it is cached); until it exists the daemon first serves the same pair trained for
# under a minute, and the trained one is swapped in when it is ready, by the control
# plane's own rollout restart.
source "$(dirname "$0")/env.sh"
PORT="${SPECD_PORT:-8000}"
PIDFILE=state/daemon.pid

# A daemon a previous run started is stopped (it drains, then removes its pid
# file); a pid file whose process is gone, or is not specd, is stale.
stop_previous_daemon() {
  [ -e "$PIDFILE" ] || return 0
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  if [[ "$pid" =~ ^[0-9]+$ ]] && ps -p "$pid" -o args= 2>/dev/null | grep -q "specd.* daemon"; then
    echo "==> stopping the specd daemon a previous run started (pid $pid)"
    kill "$pid"
    for _ in $(seq 90); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "quickstart: pid $pid did not stop within 45 s; stop it, then run this again" >&2
      exit 1
    fi
  else
    echo "==> removing a stale $PIDFILE (no specd daemon runs as pid ${pid:-?})"
  fi
  rm -f "$PIDFILE"
}

mkdir -p state
TRAIN_LATER=""
if specd forge models/demo --preset demo --check; then
  specd forge models/demo --preset demo >/dev/null  # the trained pair is kept; what a newer forge adds is written
else
  echo "==> forging the quick demo pair (under a minute of training); the trained pair follows in the background"
  specd forge models/demo --preset quick
  TRAIN_LATER=1
fi
stop_previous_daemon
echo "==> starting specd daemon on http://127.0.0.1:$PORT (log: state/daemon.log)"
# --drop-hosted-tools: Codex CLI sends OpenAI's hosted web_search tool by default (docs/clients.md)
nohup specd daemon --manifests manifests/demo --state-dir state --port "$PORT" --pid-file "$PIDFILE" \
  --drop-hosted-tools >state/daemon.log 2>&1 &
DAEMON=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
  kill -0 "$DAEMON" 2>/dev/null || { cat state/daemon.log; exit 1; }
  sleep 0.5
done
# The demo models are tiny and learned Python from the standard library's sources (not
# chat transcripts), so ask for code: the reply continues it with Python-looking text.
# Sampled, since greedy decoding soon repeats one line ("#") with a model this small.
echo "==> POST /v1/chat/completions"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "demo",
  "messages": [{"role": "user", "content": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"}],
  "max_tokens": 64, "temperature": 0.8, "top_p": 0.95, "seed": 1
}' | python -m json.tool
# demo-vision: the demo target as the language model of a LLaVA checkpoint (its vision tower is
# random: images change the reply, it was never taught what they show).
echo "==> POST /v1/chat/completions with an image (demo-vision)"
python - "$PORT" <<'PY'
import base64, io, json, sys, urllib.request
from PIL import Image, ImageDraw
image = Image.new("RGB", (96, 64), "white")
ImageDraw.Draw(image).ellipse((24, 8, 72, 56), fill="red")
buffer = io.BytesIO()
image.save(buffer, "PNG")
body = {"model": "demo-vision", "max_tokens": 32, "temperature": 0.8, "seed": 1,
        "chat_template_kwargs": {"enable_thinking": False}, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}},
    {"type": "text", "text": "def draw_circle(canvas):"}]}]}
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(request, timeout=120)), indent=4))
PY
if [ -n "$TRAIN_LATER" ]; then
  # One trainer at a time: a run still training from before swaps the pair in itself.
  TRAINER="$(cat state/forge.pid 2>/dev/null || true)"
  if [[ "$TRAINER" =~ ^[0-9]+$ ]] && ps -p "$TRAINER" -o args= 2>/dev/null | grep -q "forge models/demo"; then
    echo "==> the demo pair is still training from an earlier run (pid $TRAINER, log state/forge.log)"
  else
    URL="http://127.0.0.1:$PORT"
    # the trainer writes its pid file and removes it when it ends, however it ends
    nohup bash -c "echo \$\$ >state/forge.pid; trap 'rm -f state/forge.pid' EXIT; specd forge models/demo --preset demo \
      && specd rollout restart model demo --server $URL && specd rollout restart model demo-agent --server $URL \
      && echo '==> the trained demo pair is serving'" >state/forge.log 2>&1 &
    echo "==> training the demo pair in the background (about 21 minutes, log state/forge.log);"
    echo "    the daemon swaps it in for the quick pair when it is ready (specd describe model demo: its events)"
  fi
fi
SERVER=""
[ "$PORT" = 8000 ] || SERVER="
      export SPECD_SERVER=http://127.0.0.1:$PORT"
cat <<EOF
==> specd is serving on http://127.0.0.1:$PORT (pid $DAEMON, log state/daemon.log)
    Web console (Nodes, Models, a playground, apply): http://127.0.0.1:$PORT/ui/
    The specd command lives in .venv; in a new shell, activate it first:
      source .venv/bin/activate$SERVER
      specd get models
    (or run .venv/bin/specd directly). Stop the daemon with: kill \$(cat $PIDFILE)
EOF
