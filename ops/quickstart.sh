#!/usr/bin/env bash
# Install specd, forge the demo model pair (trained once, ~10 min, then cached),
# start the daemon on manifests/demo and ask it for a chat completion.
source "$(dirname "$0")/env.sh"
PORT="${SPECD_PORT:-8000}"
specd forge models/demo --preset demo
mkdir -p state
echo "==> starting specd daemon on http://127.0.0.1:$PORT (log: state/daemon.log)"
nohup specd daemon --manifests manifests/demo --state-dir state --port "$PORT" >state/daemon.log 2>&1 &
echo $! >state/daemon.pid
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
  kill -0 "$(cat state/daemon.pid)" 2>/dev/null || { cat state/daemon.log; exit 1; }
  sleep 0.5
done
# The demo models learned Python from the standard library's sources (not chat
# transcripts), so ask for code: the reply continues it, speculating with n-gram lookup.
echo "==> POST /v1/chat/completions"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "demo",
  "messages": [{"role": "user", "content": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"}],
  "max_tokens": 64, "temperature": 0
}' | python -m json.tool
echo "==> specd is serving on http://127.0.0.1:$PORT (pid $(cat state/daemon.pid)); stop it with: kill \$(cat state/daemon.pid)"
