#!/usr/bin/env bash
# The sluice demo: builds Caddy with sluice (./xcaddy.sh), sluice-agent and a
# sample private web app, starts all three on loopback, and prints the curl
# that reaches the app through Caddy and the tunnel.
#
#   demo/run.sh            # runs until Ctrl-C
#   demo/run.sh --check    # starts, runs the curl itself, stops (used by tests)
#
# Ports (override with the environment): DEMO_HTTP_PORT (8080, the public
# site), DEMO_CONTROL_PORT (8001, where agents dial), DEMO_UPSTREAM_PORT
# (3000, the private app). DEMO_WORK is where the demo keeps its files
# (default .demo in the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

HTTP_PORT=${DEMO_HTTP_PORT:-8080}
CONTROL_PORT=${DEMO_CONTROL_PORT:-8001}
UPSTREAM_PORT=${DEMO_UPSTREAM_PORT:-3000}
CHECK=0
[ "${1:-}" = "--check" ] && CHECK=1

WORK=${DEMO_WORK:-$ROOT/.demo}
mkdir -p "$WORK/bin" "$WORK/data"

# DEMO_CADDY_BIN uses a Caddy built already (the tests pass the one test.sh built).
CADDY_BIN=${DEMO_CADDY_BIN:-$ROOT/caddy}
if [ -z "${DEMO_CADDY_BIN:-}" ]; then
	newest_go=$(find . -name '*.go' -newer "$CADDY_BIN" -not -path './.demo/*' -print -quit 2>/dev/null || true)
	if [ ! -x "$CADDY_BIN" ] || [ -n "$newest_go" ]; then
		echo "==> building Caddy with sluice (./xcaddy.sh; the first build takes a few minutes)"
		./xcaddy.sh
	fi
fi
echo "==> building sluice-agent and the sample upstream"
go build -o "$WORK/bin/sluice-agent" ./agent/cmd/sluice-agent
go build -o "$WORK/bin/upstream" ./demo/upstream

TOKEN=demo-token-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
cat > "$WORK/Caddyfile" <<CADDY
{
	admin off
	persist_config off
	auto_https off
	storage file_system $WORK/data
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
	}
}

# Every request for localhost on this port goes through the tunnel to
# whichever agent serves the host "localhost".
http://localhost:$HTTP_PORT {
	bind 127.0.0.1
	sluice
}
CADDY

pids=()
agent_pid=""
cleanup() {
	trap - EXIT INT TERM
	# The agent first, so that it leaves the node gracefully. A Ctrl-C
	# reached it already (same process group), and a second signal would
	# cut what it still serves: give it a moment to leave on its own.
	if [ -n "$agent_pid" ]; then
		if [ "${interrupted:-0}" = 0 ]; then
			kill -TERM "$agent_pid" 2>/dev/null || true
		fi
		for _ in $(seq 1 30); do # up to 3 s
			kill -0 "$agent_pid" 2>/dev/null || break
			sleep 0.1
		done
	fi
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'interrupted=1; exit 130' INT
trap 'exit 143' TERM

"$WORK/bin/upstream" -listen "127.0.0.1:$UPSTREAM_PORT" -name "the private upstream" >"$WORK/upstream.log" 2>&1 &
pids+=($!)
"$CADDY_BIN" run --config "$WORK/Caddyfile" --adapter caddyfile >"$WORK/caddy.log" 2>&1 &
pids+=($!)
"$WORK/bin/sluice-agent" -server "grpc://127.0.0.1:$CONTROL_PORT" -token "$TOKEN" -id demo-agent \
	-upstream "localhost=http://127.0.0.1:$UPSTREAM_PORT" >"$WORK/agent.log" 2>&1 &
agent_pid=$!
pids+=($!)

url="http://localhost:$HTTP_PORT/"
up=0
for _ in $(seq 1 150); do # up to 15 s
	if [ "$(curl -s -o /dev/null -w '%{http_code}' "$url" || true)" = 200 ]; then
		up=1
		break
	fi
	sleep 0.1
done
if [ "$up" = 0 ]; then
	echo "==> the demo did not come up within 15 s: $url does not answer 200" >&2
	for f in caddy agent upstream; do
		echo "---- $WORK/$f.log (last 15 lines)" >&2
		tail -n 15 "$WORK/$f.log" >&2 || true
	done
	exit 1
fi

echo
echo "==> sluice demo is up: Caddy :$HTTP_PORT  ->  tunnel (control 127.0.0.1:$CONTROL_PORT)  ->  agent  ->  app 127.0.0.1:$UPSTREAM_PORT"
echo "    logs in $WORK/*.log"
echo
echo "    try:  curl $url"
echo
if [ "$CHECK" = 1 ]; then
	curl -sS --max-time 10 "$url"
	exit 0
fi
curl -sS --max-time 10 "$url" || true
echo
echo "(Ctrl-C stops the demo)"
wait
