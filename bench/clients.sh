#!/usr/bin/env bash
# bench/clients.sh: real clients against the ceiling Caddy sets for each, in
# one run, each load over its paths in turn (the order reversed every other
# round), medians of the rounds:
#
#   grpc    ghz, unary calls (grpc.health.v1.Health/Check) over h2c:
#             direct  ghz -> grpc upstream
#             caddy   ghz -> Caddy `reverse_proxy h2c://...`           (the ceiling)
#             hop     ghz -> Caddy `reverse_proxy h2c://...` -> bench/tcprelay -> upstream
#             sluice  ghz -> Caddy `sluice { transport sluice { versions h2c } }` -> agent -> upstream
#   redis   redis-benchmark -P 1 (SET and GET, one command per round trip):
#             direct  redis-benchmark -> redis-server
#             l4      redis-benchmark -> caddy-l4 `proxy`                (the ceiling)
#             hop     redis-benchmark -> caddy-l4 `proxy` -> bench/tcprelay -> redis-server
#             sluice  redis-benchmark -> caddy-l4 `sluice redis` -> agent -> redis-server
#   churn   wrk -H "Connection: close": a new client connection per request
#             direct / caddy (`reverse_proxy`, the ceiling) / hop / sluice
#
# The hop paths add one bare relay process (bench/tcprelay) behind the
# ceiling: what any tunnel pays at least for its extra process on this
# machine. The table gives sluice/ceiling, sluice/hop and sluice/direct
# ratios plus the
# targets (informational: the exit status is non-zero only when the setup
# fails, never because a target is missed).
#
#   bench/clients.sh                  # full run (10 s per load and path, 3 rounds)
#   BENCH_QUICK=1 bench/clients.sh    # quick run (3 s, 1 round)
#   CADDY=/path/to/caddy bench/clients.sh
#
# Needs ghz (go install github.com/bojand/ghz/cmd/ghz@v0.120.0), redis-server
# and redis-benchmark (Debian: redis-server, redis-tools), wrk and curl.
# Everything binds 127.0.0.1; every wait is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

GHZ=${GHZ:-$(command -v ghz || echo "$(go env GOPATH)/bin/ghz")}
[ -x "$GHZ" ] || { log "ghz is required (go install github.com/bojand/ghz/cmd/ghz@v0.120.0)"; exit 1; }
for tool in redis-server redis-benchmark jq; do
	command -v "$tool" >/dev/null 2>&1 || { log "$tool is required (Debian: redis-server, redis-tools, jq)"; exit 1; }
done
LOAD_SECS=${WRK_DURATION%s}
CONNS=${BENCH_CONNS:-32} # ghz and redis-benchmark clients; wrk uses 64 (lib.sh)

bench_setup sluice-bench-clients
find_caddy
modules=$("$CADDY" list-modules 2>/dev/null) || die "$CADDY list-modules failed"
for m in layer4.handlers.proxy layer4.handlers.sluice; do
	grep -qx "$m" <<<"$modules" || die "$CADDY has no $m module (build it with ./xcaddy.sh)"
done
build_binaries
go build -o "$tmp/grpcupstream" ./bench/grpcupstream >>"$tmp/build.log" 2>&1 || die "go build bench/grpcupstream"

# ---------------------------------------------------------------- processes

free_ports UP_PORT GRPC_PORT REDIS_PORT CONTROL_PORT CADDY_PORT SLUICE_PORT GCADDY_PORT GSLUICE_PORT L4_PORT RSLUICE_PORT \
	HOP_PORT GHOP_PORT RHOP_PORT RELAY_UP RELAY_GRPC RELAY_REDIS

"$tmp/grpcupstream" -listen "127.0.0.1:$GRPC_PORT" >"$tmp/grpcupstream.log" 2>&1 &
GRPC_PID=$!
pids+=("$GRPC_PID")
redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no --protected-mode yes \
	--dir "$tmp" >"$tmp/redis.log" 2>&1 &
REDIS_PID=$!
pids+=("$REDIS_PID")
start_upstream "127.0.0.1:$UP_PORT"
# one bare relay per origin for the hop paths
for pair in "$RELAY_UP:$UP_PORT" "$RELAY_GRPC:$GRPC_PORT" "$RELAY_REDIS:$REDIS_PORT"; do
	"$tmp/tcprelay" -listen "127.0.0.1:${pair%:*}" -to "127.0.0.1:${pair#*:}" >>"$tmp/relay.log" 2>&1 &
	pids+=("$!")
done

cat >"$tmp/Caddyfile" <<EOF
{
$(caddy_globals)
	servers {
		protocols h1 h2c
	}
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
	}
	layer4 {
		127.0.0.1:$L4_PORT {
			route {
				proxy 127.0.0.1:$REDIS_PORT
			}
		}
		127.0.0.1:$RHOP_PORT {
			route {
				proxy 127.0.0.1:$RELAY_REDIS
			}
		}
		127.0.0.1:$RSLUICE_PORT {
			route {
				sluice redis
			}
		}
	}
}

http://$HOST:$CADDY_PORT {
	bind 127.0.0.1
	reverse_proxy 127.0.0.1:$UP_PORT
}

http://$HOST:$HOP_PORT {
	bind 127.0.0.1
	reverse_proxy 127.0.0.1:$RELAY_UP
}

http://$HOST:$SLUICE_PORT {
	bind 127.0.0.1
	sluice
}

http://grpc.test:$GCADDY_PORT {
	bind 127.0.0.1
	reverse_proxy h2c://127.0.0.1:$GRPC_PORT
}

http://grpc.test:$GHOP_PORT {
	bind 127.0.0.1
	reverse_proxy h2c://127.0.0.1:$RELAY_GRPC
}

http://grpc.test:$GSLUICE_PORT {
	bind 127.0.0.1
	sluice {
		transport sluice {
			versions h2c
		}
	}
}
EOF
start_caddy
start_agent -upstream "host=$HOST,target=http://127.0.0.1:$UP_PORT" \
	-upstream "host=grpc.test,target=http://127.0.0.1:$GRPC_PORT" \
	-upstream "name=redis,target=tcp://127.0.0.1:$REDIS_PORT"

wait_ok "upstream" "http://127.0.0.1:$UP_PORT/" "$UP_PID"
wait_ok "caddy" "http://127.0.0.1:$CADDY_PORT/" "$CADDY_PID"
wait_ok "hop" "http://127.0.0.1:$HOP_PORT/" "$CADDY_PID"
wait_ok "sluice" "http://127.0.0.1:$SLUICE_PORT/" "$AGENT_PID"

# wait_cmd NAME PID CMD...: runs CMD until it succeeds (bounded).
wait_cmd() {
	local name=$1 pid=$2 end=$((SECONDS + READY_TIMEOUT))
	shift 2
	until "$@" >/dev/null 2>&1; do
		kill -0 "$pid" 2>/dev/null || die "$name exited"
		[ "$SECONDS" -lt "$end" ] || die "$name not ready after ${READY_TIMEOUT}s"
		sleep 0.05
	done
}
ghz_once() { "$GHZ" --insecure --call grpc.health.v1.Health/Check -n 1 -c 1 --authority grpc.test --timeout 2s "$1" | grep -q 'OK'; }
wait_cmd "grpc upstream" "$GRPC_PID" ghz_once "127.0.0.1:$GRPC_PORT"
wait_cmd "grpc through caddy" "$CADDY_PID" ghz_once "127.0.0.1:$GCADDY_PORT"
wait_cmd "grpc through caddy and the relay" "$CADDY_PID" ghz_once "127.0.0.1:$GHOP_PORT"
wait_cmd "grpc through sluice" "$AGENT_PID" ghz_once "127.0.0.1:$GSLUICE_PORT"
redis_once() { [ "$(redis-cli -h 127.0.0.1 -p "$1" PING)" = PONG ]; }
wait_cmd "redis" "$REDIS_PID" redis_once "$REDIS_PORT"
wait_cmd "redis through caddy-l4" "$CADDY_PID" redis_once "$L4_PORT"
wait_cmd "redis through caddy-l4 and the relay" "$CADDY_PID" redis_once "$RHOP_PORT"
wait_cmd "redis through sluice" "$AGENT_PID" redis_once "$RSLUICE_PORT"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- loads

declare -A GADDR=([direct]=127.0.0.1:$GRPC_PORT [caddy]=127.0.0.1:$GCADDY_PORT [hop]=127.0.0.1:$GHOP_PORT [sluice]=127.0.0.1:$GSLUICE_PORT)
declare -A RPORT=([direct]=$REDIS_PORT [l4]=$L4_PORT [hop]=$RHOP_PORT [sluice]=$RSLUICE_PORT)
declare -A URL=([direct]=http://127.0.0.1:$UP_PORT [caddy]=http://127.0.0.1:$CADDY_PORT [hop]=http://127.0.0.1:$HOP_PORT [sluice]=http://127.0.0.1:$SLUICE_PORT)

# grpc PATH: ghz, CONNS concurrent unary calls on CONNS connections for LOAD_SECS.
grpc() {
	local p=$1 f=$tmp/ghz.$1
	"${PIN_PUBLIC[@]}" "$GHZ" --insecure --call grpc.health.v1.Health/Check --authority grpc.test \
		-c "$CONNS" --connections "$CONNS" -z "${LOAD_SECS}s" --timeout 5s -O json "${GADDR[$p]}" >"$f" 2>"$f.err" ||
		{ warn "$p: ghz failed: $(tail -n 3 "$f.err")"; return 0; }
	R[grpc_rps,$p]=$(jq -r '.rps | floor' "$f")
	R[grpc_p50,$p]=$(jq -r '[.latencyDistribution[] | select(.percentage == 50)][0].latency / 1e6 | . * 100 | round / 100' "$f")
	# ghz closes its connections at the end of -z under the calls in flight
	# ("use of closed network connection", "the client connection is
	# closing"): those are not failures.
	local bad
	bad=$(jq -r '[(.errorDistribution // {}) | to_entries[]
		| select(.key | (contains("use of closed network connection") or contains("the client connection is closing")) | not)
		| .value] | add // 0' "$f")
	[ "$bad" = 0 ] || warn "$p: ghz: $bad calls failed: $(jq -c '.errorDistribution' "$f" | head -c 300)"
}

# redis PATH: redis-benchmark -P 1, SET and GET, CONNS clients, ~LOAD_SECS each.
redis() {
	local p=$1 f=$tmp/redis.$1 n
	n=$((LOAD_SECS * 12000)) # ~LOAD_SECS at loopback rates through a relay
	"${PIN_PUBLIC[@]}" redis-benchmark -h 127.0.0.1 -p "${RPORT[$p]}" -c "$CONNS" -n "$n" -P 1 -t set,get --csv >"$f" 2>&1 ||
		{ warn "$p: redis-benchmark failed: $(tail -n 3 "$f")"; return 0; }
	R[redis_set,$p]=$(awk -F'"' '$2 == "SET" { printf "%.0f", $4 }' "$f")
	R[redis_get,$p]=$(awk -F'"' '$2 == "GET" { printf "%.0f", $4 }' "$f")
}

# churn PATH: wrk with Connection: close, so every request is a new client connection.
churn() {
	local p=$1 f=$tmp/churn.$1 v
	"${PIN_PUBLIC[@]}" wrk -t2 -c64 -d"$WRK_DURATION" -H "Host: $HOST" -H "Connection: close" "${URL[$p]}/" >"$f" 2>&1 ||
		{ warn "$p: wrk failed: $(tail -n 3 "$f")"; return 0; }
	R[churn,$p]=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' "$f")
	v=$(awk -F': *' '/Non-2xx or 3xx responses/ { print $2 }' "$f")
	[ -z "$v" ] || warn "$p: wrk: $v non-2xx/3xx responses"
}

log "1. ghz: unary gRPC, $CONNS connections, ${LOAD_SECS}s per path"
paths=(direct caddy hop sluice)
each_path grpc
log "2. redis-benchmark -P 1 -c $CONNS (SET, GET)"
paths=(direct l4 hop sluice)
each_path redis
log "3. wrk -c64 with Connection: close"
paths=(direct caddy hop sluice)
each_path churn

# ---------------------------------------------------------------- report

report_header clients "every process on this machine shares its CPUs (clients included)"
FMT='%-38s | %9s | %9s | %9s | %9s | %14s | %10s | %13s\n'
# line LABEL KEY CEILING: direct, ceiling, hop, sluice and the ratios.
line() {
	printf "$FMT" "$1" "${R[$2,direct]:--}" "${R[$2,$3]:--}" "${R[$2,hop]:--}" "${R[$2,sluice]:--}" \
		"$(ratio "${R[$2,sluice]:-}" "${R[$2,$3]:-}")" "$(ratio "${R[$2,sluice]:-}" "${R[$2,hop]:-}")" \
		"$(ratio "${R[$2,sluice]:-}" "${R[$2,direct]:-}")"
}
printf "$FMT" metric direct ceiling hop sluice sluice/ceiling sluice/hop sluice/direct
printf '%s\n' "---------------------------------------+-----------+-----------+-----------+-----------+----------------+------------+--------------"
line "gRPC unary calls/s (ceiling: caddy)" grpc_rps caddy
line "gRPC p50 ms (lower=better)" grpc_p50 caddy
line "redis SET/s -P 1 (ceiling: l4 proxy)" redis_set l4
line "redis GET/s -P 1 (ceiling: l4 proxy)" redis_get l4
line "Connection: close req/s (caddy)" churn caddy
echo
echo "ghz -c $CONNS --connections $CONNS -z ${LOAD_SECS}s; redis-benchmark -c $CONNS -P 1 -t set,get; wrk -t2 -c64 -d$WRK_DURATION -H 'Connection: close'"
echo
echo "targets (sluice/ceiling; informational):"
BASE=caddy target "gRPC unary calls/s" grpc_rps 0.85 sluice
BASE=l4 target "redis SET -P 1" redis_set 0.85 sluice
BASE=l4 target "redis GET -P 1" redis_get 0.85 sluice
BASE=caddy target "new connections/s (Connection: close)" churn 0.9 sluice
echo "reference (hop/ceiling: what one more bare process costs by itself on this machine):"
printf '  %-44s %s\n' "gRPC unary calls/s" "$(ratio "${R[grpc_rps,hop]:-}" "${R[grpc_rps,caddy]:-}")"
printf '  %-44s %s\n' "redis SET -P 1" "$(ratio "${R[redis_set,hop]:-}" "${R[redis_set,l4]:-}")"
printf '  %-44s %s\n' "redis GET -P 1" "$(ratio "${R[redis_get,hop]:-}" "${R[redis_get,l4]:-}")"
printf '  %-44s %s\n' "new connections/s (Connection: close)" "$(ratio "${R[churn,hop]:-}" "${R[churn,caddy]:-}")"
report_warnings
