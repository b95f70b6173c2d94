#!/usr/bin/env bash
# bench/tcp.sh: one run, one load, the raw TCP path four ways to the same
# sample upstream (an HTTP server, so HTTP loads run over the TCP relays):
#
#   direct  curl/wrk -> upstream
#   l4      curl/wrk -> caddy-l4 `proxy` -> upstream         (ceiling of any TCP path in Caddy)
#   sluice  curl/wrk -> caddy-l4 `sluice bench` -> gRPC stream -> sluice-agent -> upstream
#   port    curl/wrk -> port claimed by the agent (tcp_port_range) -> gRPC stream -> agent -> upstream
#
# and prints a table with sluice/l4, sluice/direct and port/l4 ratios plus
# the performance targets (informational: the exit status is non-zero only
# when the setup fails, never because a target is missed).
#
#   bench/tcp.sh                   # full run (1 GiB, wrk 10 s, 500 idle conns)
#   BENCH_QUICK=1 bench/tcp.sh     # quick run (64 MiB, wrk 3 s, 100 idle conns)
#   CADDY=/path/to/caddy bench/tcp.sh   # use that xcaddy build as is
#
# Without CADDY, ./caddy is used when it is newer than every non-test *.go
# file, go.mod and go.sum; otherwise ./xcaddy.sh rebuilds it first. The build
# must include caddy-l4 (its `proxy` handler) and sluice's l4module.
# Needs curl and wrk. Everything binds 127.0.0.1; every wait is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${BENCH_QUICK:-0}" = 1 ]; then
	MODE=quick
	SINGLE_SIZE=$((64 << 20))
	WRK_DURATION=3s
	IDLE_N=100
else
	MODE=full
	SINGLE_SIZE=$((1 << 30))
	WRK_DURATION=10s
	IDLE_N=500
fi
TTFB_RUNS=20
HOST=app.test
TOKEN=bench
ROUTE=bench
READY_TIMEOUT=30 # seconds, per component

log() { echo "bench: $*" >&2; }

for tool in curl wrk go awk; do
	command -v "$tool" >/dev/null 2>&1 || { log "$tool is required"; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/sluice-bench-tcp.XXXXXX")
pids=()

cleanup() {
	local status=$? p i
	trap - EXIT INT TERM
	# TERM every child (the idleconns helpers included), KILL what outlives 5 s.
	for p in "${pids[@]}" $(jobs -p); do
		kill -TERM "$p" 2>/dev/null || true
	done
	for p in "${pids[@]}" $(jobs -p); do
		for i in $(seq 1 50); do # up to 5 s each
			kill -0 "$p" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$p" 2>/dev/null || true
		wait "$p" 2>/dev/null || true
	done
	rm -rf "$tmp"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

die() {
	log "SETUP FAILED: $*"
	local f
	for f in "$tmp"/*.log; do
		[ -s "$f" ] || continue
		echo "---- $(basename "$f") (last 20 lines)" >&2
		tail -n 20 "$f" >&2
	done
	exit 1
}

# ---------------------------------------------------------------- binaries

if [ -n "${CADDY:-}" ]; then
	[ -x "$CADDY" ] || die "CADDY=$CADDY is not executable"
else
	CADDY=$ROOT/caddy
	stale=""
	if [ -x "$CADDY" ]; then
		stale=$(find . -path ./bench -prune -o -path ./.git -prune -o \
			\( \( -name '*.go' ! -name '*_test.go' \) -o -name go.mod -o -name go.sum \) \
			-newer "$CADDY" -print -quit)
	fi
	if [ ! -x "$CADDY" ] || [ -n "$stale" ]; then
		log "building ./caddy with ./xcaddy.sh${stale:+ ($stale is newer)}; the first build takes minutes"
		./xcaddy.sh >"$tmp/xcaddy.log" 2>&1 || die "./xcaddy.sh failed"
	fi
fi
modules=$("$CADDY" list-modules 2>/dev/null) || die "$CADDY list-modules failed"
for m in layer4.handlers.proxy layer4.handlers.sluice; do
	grep -qx "$m" <<<"$modules" || die "$CADDY has no $m module (build it with ./xcaddy.sh)"
done

log "building sluice-agent, the sample upstream and the bench helpers"
go build -o "$tmp/sluice-agent" ./agent/cmd/sluice-agent >"$tmp/build.log" 2>&1 || die "go build sluice-agent"
go build -o "$tmp/upstream" ./demo/upstream >>"$tmp/build.log" 2>&1 || die "go build demo/upstream"
go build -o "$tmp/idleconns" ./bench/idleconns >>"$tmp/build.log" 2>&1 || die "go build bench/idleconns"
go build -o "$tmp/freeports" ./bench/freeports >>"$tmp/build.log" 2>&1 || die "go build bench/freeports"

# ---------------------------------------------------------------- processes

ports=$("$tmp/freeports" -n 5) || die "no free ports"
read -r UP_PORT CONTROL_PORT L4_PORT SLUICE_PORT CLAIM_PORT <<<"$(echo $ports)"
[ -n "$CLAIM_PORT" ] || die "freeports returned too few ports: $ports"

paths=(direct l4 sluice port)
declare -A ADDR=(
	[direct]=127.0.0.1:$UP_PORT
	[l4]=127.0.0.1:$L4_PORT
	[sluice]=127.0.0.1:$SLUICE_PORT
	[port]=127.0.0.1:$CLAIM_PORT
)

# wait_ok NAME URL PID: poll URL (with Host: app.test) until it answers 200.
# Over a TCP relay, "not yet" is a refused or closed connection: curl fails
# and the loop tries again.
wait_ok() {
	local name=$1 url=$2 pid=$3 code end=$((SECONDS + READY_TIMEOUT))
	while :; do
		code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 -H "Host: $HOST" "$url" || true)
		[ "$code" = 200 ] && return 0
		kill -0 "$pid" 2>/dev/null || die "$name exited"
		[ "$SECONDS" -lt "$end" ] || die "$name: $url not 200 after ${READY_TIMEOUT}s (last status $code)"
		sleep 0.05
	done
}

"$tmp/upstream" -listen "${ADDR[direct]}" -name bench >"$tmp/upstream.log" 2>&1 &
UP_PID=$!
pids+=("$UP_PID")

mkdir -p "$tmp/storage" "$tmp/xdg-data" "$tmp/xdg-config"
cat >"$tmp/Caddyfile" <<EOF
{
	admin off
	persist_config off
	auto_https off
	storage file_system $tmp/storage
	log default {
		output stderr
		level ERROR
	}
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
		# (d) the agent claims this one port for its listen-port route
		tcp_port_range $CLAIM_PORT-$CLAIM_PORT
		tcp_bind 127.0.0.1
	}
	layer4 {
		# (b) the ceiling: caddy-l4's own proxy to the upstream
		127.0.0.1:$L4_PORT {
			route {
				proxy 127.0.0.1:$UP_PORT
			}
		}
		# (c) the tunnel: the agent route named $ROUTE
		127.0.0.1:$SLUICE_PORT {
			route {
				sluice $ROUTE
			}
		}
	}
}
EOF

XDG_DATA_HOME=$tmp/xdg-data XDG_CONFIG_HOME=$tmp/xdg-config \
	"$CADDY" run --config "$tmp/Caddyfile" --adapter caddyfile >"$tmp/caddy.log" 2>&1 &
CADDY_PID=$!
pids+=("$CADDY_PID")

wait_ok upstream "http://${ADDR[direct]}/" "$UP_PID"
wait_ok "caddy (l4 proxy)" "http://${ADDR[l4]}/" "$CADDY_PID"

"$tmp/sluice-agent" -server "grpc://127.0.0.1:$CONTROL_PORT" -token "$TOKEN" -id bench -log-level error \
	-upstream "name=$ROUTE,target=tcp://${ADDR[direct]}" \
	-upstream "listen_port=$CLAIM_PORT,target=tcp://${ADDR[direct]}" >"$tmp/agent.log" 2>&1 &
AGENT_PID=$!
pids+=("$AGENT_PID")

wait_ok "sluice-agent (via caddy-l4 sluice)" "http://${ADDR[sluice]}/" "$AGENT_PID"
wait_ok "sluice-agent (via claimed port)" "http://${ADDR[port]}/" "$AGENT_PID"
log "ready: upstream :$UP_PORT, l4 proxy :$L4_PORT, l4 sluice :$SLUICE_PORT, claimed port :$CLAIM_PORT, control :$CONTROL_PORT"

# ---------------------------------------------------------------- helpers

declare -A R # results: R[metric,path]

# calc FORMAT EXPR: evaluates an awk expression.
calc() {
	local fmt=$1
	shift
	awk "BEGIN { printf \"$fmt\", $* }" </dev/null
}

# to_ms VALUE: wrk latency ("812.00us", "1.23ms", "1.05s", "2.00m") in ms.
to_ms() {
	awk -v v="$1" 'BEGIN {
		if (v ~ /us$/) { sub(/us$/, "", v); printf "%.3f", v / 1000 }
		else if (v ~ /ms$/) { sub(/ms$/, "", v); printf "%.3f", v }
		else if (v ~ /m$/) { sub(/m$/, "", v); printf "%.3f", v * 60000 }
		else if (v ~ /s$/) { sub(/s$/, "", v); printf "%.3f", v * 1000 }
		else printf "-"
	}'
}

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }

# CPU accounting: utime+stime (clock ticks) of Caddy, the agent and the upstream.
CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
# machine_ticks: "busy total irq" clock ticks of all CPUs (/proc/stat); irq =
# hardirq + softirq time, which the kernel charges to no process (with this
# much loopback traffic, mostly the network stack's softirqs).
machine_ticks() { awk '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t, $7 + $8; exit }' /proc/stat; }
# children_ticks: CPU of this script's finished children (curl, wrk): cutime+cstime.
children_ticks() { awk '{ print $16 + $17 }' "/proc/$$/stat"; }
cpu_start() {
	cpu0=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)")
	read -r busy0 total0 irq0 < <(machine_ticks)
}
# cpu_stop KEY PATH UNITS SCALE: R[KEY_<process>,PATH] = CPU seconds / UNITS * SCALE
# for the processes PATH goes through.
cpu_stop() {
	local key=$1 p=$2 units=$3 scale=$4 now busy total irq
	now=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)")
	read -r busy total irq < <(machine_ticks)
	R[${key}_busy,$p]=$(calc %.0f "100 * ($busy - $busy0) / ($total - $total0 + 1)")
	R[${key}_irq,$p]=$(calc %.0f "100 * ($irq - $irq0) / ($total - $total0 + 1)")
	# busy time of the machine not spent in this bench's processes, its
	# clients or interrupts (clamped at 0: a client's ticks land at its exit)
	local ours="(${now[0]} - ${cpu0[0]}) + (${now[1]} - ${cpu0[1]}) + (${now[2]} - ${cpu0[2]}) + (${now[3]} - ${cpu0[3]}) + ($irq - $irq0)"
	R[${key}_other,$p]=$(calc %.0f "100 * ((o = ($busy - $busy0) - ($ours)) > 0 ? o : 0) / ($total - $total0 + 1)")
	cpu_set() { R[${key}_$1,$p]=$(calc %.2f "(${now[$2]} - ${cpu0[$2]}) / $CLK_TCK / ($units) * $scale"); }
	case $p in
	l4) cpu_set caddy 0 ;;
	sluice | port) cpu_set caddy 0 && cpu_set agent 1 ;;
	esac
	cpu_set upstream 2
}

# ---------------------------------------------------------------- (3) idle connection RSS
# First, while Caddy and the agent are fresh: memory freed by a load is kept
# by the Go runtime and reused, which would hide the cost of new connections.
# Each batch stays open while the next is opened, so each lands on fresh
# memory. idleconns sends one keep-alive GET per connection (HTTP over the raw
# relay) and holds the connection idle; every relayed connection stays open
# end to end (client - Caddy - [agent] - upstream).

idle_fds=()
idle_pids=()
# idle_open NAME ADDR: opens IDLE_N idle connections, returns once they are all up.
idle_open() {
	local name=$1 addr=$2 fifo=$tmp/idle.$1.in fd pid end=$((SECONDS + 60))
	mkfifo "$fifo"
	"$tmp/idleconns" -addr "$addr" -host "$HOST" -n "$IDLE_N" -hold 60s \
		<"$fifo" >"$tmp/idle.$name.out" 2>"$tmp/idle.$name.log" &
	pid=$!
	pids+=("$pid")
	idle_pids+=("$pid")
	exec {fd}<>"$fifo" # read-write: never blocks; closing it is the helper's EOF
	idle_fds+=("$fd")
	until grep -q '^ready$' "$tmp/idle.$name.out" 2>/dev/null; do
		kill -0 "$pid" 2>/dev/null || die "idleconns ($name) failed: $(cat "$tmp/idle.$name.log")"
		[ "$SECONDS" -lt "$end" ] || die "idleconns ($name): connections not up after 60s"
		sleep 0.05
	done
}

log "3. idle connections (first, while the processes are fresh): $IDLE_N via l4 proxy, then $IDLE_N via l4 sluice, then $IDLE_N via the claimed port"
caddy0=$(rss_kib "$CADDY_PID")
agent0=$(rss_kib "$AGENT_PID")
idle_open l4 "${ADDR[l4]}"
caddy1=$(rss_kib "$CADDY_PID")
agent1=$(rss_kib "$AGENT_PID")
idle_open sluice "${ADDR[sluice]}"
caddy2=$(rss_kib "$CADDY_PID")
agent2=$(rss_kib "$AGENT_PID")
idle_open port "${ADDR[port]}"
caddy3=$(rss_kib "$CADDY_PID")
agent3=$(rss_kib "$AGENT_PID")
for fd in "${idle_fds[@]}"; do exec {fd}>&-; done
for p in "${idle_pids[@]}"; do wait "$p" || log "idleconns $p exited with $?"; done
R[rss_caddy,l4]=$(calc %.1f "($caddy1 - $caddy0) / $IDLE_N")
R[rss_caddy,sluice]=$(calc %.1f "($caddy2 - $caddy1) / $IDLE_N")
R[rss_agent,sluice]=$(calc %.1f "($agent2 - $agent1) / $IDLE_N")
R[rss_caddy,port]=$(calc %.1f "($caddy3 - $caddy2) / $IDLE_N")
R[rss_agent,port]=$(calc %.1f "($agent3 - $agent2) / $IDLE_N")
RSS_NOTE="caddy RSS ${caddy0} -> ${caddy1} -> ${caddy2} -> ${caddy3} KiB, agent RSS ${agent0} -> ${agent1} -> ${agent2} -> ${agent3} KiB"
log "$RSS_NOTE"

# ---------------------------------------------------------------- loads

warnings=()
warn() {
	warnings+=("$*")
	log "WARNING: $*"
}

# (1) one big download
single() {
	local p=$1 out code size t
	cpu_start
	out=$(curl -s -o /dev/null --max-time 300 -H "Host: $HOST" \
		-w '%{http_code} %{size_download} %{time_total}' "http://${ADDR[$p]}/download?size=$SINGLE_SIZE" || true)
	read -r code size t <<<"$out"
	if [ "$code" != 200 ] || [ "$size" != "$SINGLE_SIZE" ]; then
		warn "$p: single download: status $code, $size of $SINGLE_SIZE bytes"
	fi
	R[single,$p]=$(calc %.1f "${size:-0} / ${t:-1} / 1e6")
	cpu_stop cpu_single "$p" "${size:-0} + 1" 1e9
}

# (2) small requests with wrk (64 keep-alive connections, each one relayed
# connection for the whole run)
small() {
	local p=$1 f=$tmp/wrk.$1 v n
	cpu_start
	wrk -t2 -c64 -d"$WRK_DURATION" --latency -H "Host: $HOST" "http://${ADDR[$p]}/" >"$f" 2>&1 ||
		{ warn "$p: wrk failed: $(tail -n 3 "$f")"; return 0; }
	n=$(awk '/requests in/ { print $1 }' "$f")
	cpu_stop cpu_small "$p" "${n:-0} + 1" 1e6
	R[rps,$p]=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' "$f")
	R[p50,$p]=$(to_ms "$(awk '$1 == "50%" { print $2 }' "$f")")
	R[p99,$p]=$(to_ms "$(awk '$1 == "99%" { print $2 }' "$f")")
	v=$(awk -F': *' '/Non-2xx or 3xx responses/ { print $2 }' "$f")
	[ -z "$v" ] || warn "$p: wrk: $v non-2xx/3xx responses"
	v=$(grep -E '^ *Socket errors' "$f" || true)
	[ -z "$v" ] || warn "$p: wrk:$v"
}

# (4) time to first byte on a fresh connection (one curl process per run):
# through a TCP relay every client connection is a new upstream connection
# (through sluice: a new virtual connection and an agent dial).
ttfb() {
	local p=$1 i out code t
	: >"$tmp/ttfb.$p"
	for i in $(seq 1 "$TTFB_RUNS"); do
		out=$(curl -s -o /dev/null --max-time 10 -H "Host: $HOST" \
			-w '%{http_code} %{time_starttransfer}' "http://${ADDR[$p]}/" || true)
		read -r code t <<<"$out"
		[ "$code" = 200 ] || warn "$p: ttfb run $i: status $code"
		echo "${t:-0}" >>"$tmp/ttfb.$p"
	done
	R[ttfb,$p]=$(sort -g "$tmp/ttfb.$p" | awk '{ v[NR] = $1 } END {
		m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f", m * 1000 }')
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "1. one $((SINGLE_SIZE >> 20)) MiB download"
for p in "${paths[@]}"; do single "$p"; done
log "2. wrk -t2 -c64 -d$WRK_DURATION small requests"
for p in "${paths[@]}"; do small "$p"; done
log "4. time to first byte, median of $TTFB_RUNS fresh connections"
for p in "${paths[@]}"; do ttfb "$p"; done

# ---------------------------------------------------------------- report

ratio() { # ratio A B -> A/B with 2 decimals, or "-"
	if [[ "${1:-}" =~ ^[0-9.]+$ && "${2:-}" =~ ^[0-9.]+$ ]] && awk "BEGIN { exit !($2 > 0) }"; then
		calc %.2f "$1 / $2"
	else
		echo -n "-"
	fi
}

FMT='%-36s | %9s | %9s | %9s | %9s | %13s | %9s | %7s\n'
SEP="-------------------------------------+-----------+-----------+-----------+-----------+---------------+-----------+--------"
row() { # row KEY LABEL [noratio]
	local d=${R[$1,direct]:--} l=${R[$1,l4]:--} s=${R[$1,sluice]:--} o=${R[$1,port]:--} rl rd ro
	rl=$(ratio "$s" "$l")
	rd=$(ratio "$s" "$d")
	ro=$(ratio "$o" "$l")
	[ -z "${3:-}" ] || rl=- rd=- ro=-
	printf "$FMT" "$2" "$d" "$l" "$s" "$rl" "$rd" "$o" "$ro"
}

caddy_version=$("$CADDY" version | awk '{ print $1 }')
echo
echo "sluice TCP bench ($MODE): $(nproc) CPUs, $(go env GOVERSION), caddy $caddy_version, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "HTTP/1.1 (Host $HOST) over raw TCP relays; every process on this machine shares its CPUs (clients included)"
echo "load average before the loads: $LOAD_BEFORE; after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf "$FMT" metric direct "l4 proxy" sluice sluice/l4 sluice/direct "(d) port" port/l4
echo "$SEP"
row single "1x $((SINGLE_SIZE >> 20)) MiB download, MB/s"
row rps "small GET /, requests/s"
row p50 "small GET /, p50 ms (lower=better)"
row p99 "small GET /, p99 ms (lower=better)"
row ttfb "TTFB fresh conn, median ms (lower)"
row rss_caddy "Caddy RSS per idle conn, KiB"
row rss_agent "agent RSS per idle conn, KiB"
echo "$SEP"
row cpu_single_caddy "1x download: Caddy CPU s/GB"
row cpu_single_agent "1x download: agent CPU s/GB"
row cpu_single_upstream "1x download: upstream CPU s/GB"
row cpu_single_busy "1x download: machine CPU busy %" noratio
row cpu_single_irq "1x download: irq+softirq CPU %" noratio
row cpu_single_other "1x download: other processes CPU %" noratio
row cpu_small_caddy "small GET: Caddy CPU us/req"
row cpu_small_agent "small GET: agent CPU us/req"
row cpu_small_upstream "small GET: upstream CPU us/req"
row cpu_small_busy "small GET: machine CPU busy %" noratio
row cpu_small_irq "small GET: irq+softirq CPU %" noratio
row cpu_small_other "small GET: other processes CPU %" noratio
echo
echo "columns: l4 proxy = caddy-l4 proxy; sluice = caddy-l4 'sluice $ROUTE' (named agent route);"
echo "(d) port = sluice listen-port route: port $CLAIM_PORT claimed by the agent (listen_port, tcp_port_range) in the sluice app"
echo "idle connections: N=$IDLE_N per path, held together; $RSS_NOTE"
echo "CPU = utime+stime from /proc/<pid>/stat over the load (GB = 10^9 bytes); busy %, irq+softirq % = all CPUs (/proc/stat;"
echo "irq+softirq is mostly loopback packet processing, charged to no process); other processes = busy time not spent in"
echo "caddy, agent, upstream, the curl/wrk clients or interrupts (another load on the machine skews every number)"
echo "MB = 10^6 bytes; wrk -t2 -c64 -d$WRK_DURATION --latency; TTFB = curl time_starttransfer"

target() { # target LABEL KEY MIN PATH
	local r
	r=$(ratio "${R[$2,$4]:-}" "${R[$2,l4]:-}")
	if [ "$r" = "-" ]; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "-" "MISS (no data)"
	elif awk "BEGIN { exit !($r >= $3) }"; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" PASS
	else
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" MISS
	fi
}
echo
echo "targets (sluice/l4; informational):"
target "bulk: single download MB/s" single 0.6 sluice
target "small requests/s" rps 0.6 sluice
target "(d) port route: bulk, single download MB/s" single 0.6 port
target "(d) port route: small requests/s" rps 0.6 port

if [ "${#warnings[@]}" -gt 0 ]; then
	echo
	echo "warnings:"
	printf '  %s\n' "${warnings[@]}"
fi
exit 0
