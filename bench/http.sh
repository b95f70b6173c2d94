#!/usr/bin/env bash
# bench/http.sh: one run, one load, three paths to the same sample upstream:
#
#   direct  curl/wrk -> upstream
#   caddy   curl/wrk -> Caddy reverse_proxy -> upstream   (ceiling of any HTTP path in Caddy)
#   sluice  curl/wrk -> Caddy `sluice` -> gRPC stream -> sluice-agent -> upstream
#
# and prints a table with sluice/caddy and sluice/direct ratios plus the
# performance targets (informational: the exit status is non-zero only when
# the setup fails, never because a target is missed).
#
#   bench/http.sh                   # full run (1 GiB, 8 x 256 MiB, wrk 10 s, 500 idle conns)
#   BENCH_QUICK=1 bench/http.sh     # quick run (64 MiB, 8 x 16 MiB, wrk 3 s, 100 idle conns)
#   CADDY=/path/to/caddy bench/http.sh   # use that xcaddy build as is
#
# Without CADDY, ./caddy is used when it is newer than every non-test *.go
# file, go.mod and go.sum; otherwise ./xcaddy.sh rebuilds it first.
# Needs curl and wrk. Everything binds 127.0.0.1; every wait is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${BENCH_QUICK:-0}" = 1 ]; then
	MODE=quick
	SINGLE_SIZE=$((64 << 20))
	PAR_SIZE=$((16 << 20))
	WRK_DURATION=3s
	IDLE_N=100
else
	MODE=full
	SINGLE_SIZE=$((1 << 30))
	PAR_SIZE=$((256 << 20))
	WRK_DURATION=10s
	IDLE_N=500
fi
PAR_N=8
TTFB_RUNS=20
HOST=app.test
TOKEN=bench
READY_TIMEOUT=30 # seconds, per component

log() { echo "bench: $*" >&2; }

for tool in curl wrk go awk; do
	command -v "$tool" >/dev/null 2>&1 || { log "$tool is required"; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/sluice-bench.XXXXXX")
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

log "building sluice-agent, the sample upstream and the bench helpers"
go build -o "$tmp/sluice-agent" ./agent/cmd/sluice-agent >"$tmp/build.log" 2>&1 || die "go build sluice-agent"
go build -o "$tmp/upstream" ./demo/upstream >>"$tmp/build.log" 2>&1 || die "go build demo/upstream"
go build -o "$tmp/idleconns" ./bench/idleconns >>"$tmp/build.log" 2>&1 || die "go build bench/idleconns"
go build -o "$tmp/freeports" ./bench/freeports >>"$tmp/build.log" 2>&1 || die "go build bench/freeports"

# ---------------------------------------------------------------- processes

ports=$("$tmp/freeports" -n 4) || die "no free ports"
read -r UP_PORT CONTROL_PORT PROXY_PORT SLUICE_PORT <<<"$(echo $ports)"
[ -n "$SLUICE_PORT" ] || die "freeports returned too few ports: $ports"
DIRECT_URL=http://127.0.0.1:$UP_PORT
CADDY_URL=http://127.0.0.1:$PROXY_PORT
SLUICE_URL=http://127.0.0.1:$SLUICE_PORT

# wait_ok NAME URL PID: poll URL (with Host: app.test) until it answers 200.
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

"$tmp/upstream" -listen "127.0.0.1:$UP_PORT" -name bench >"$tmp/upstream.log" 2>&1 &
UP_PID=$!
pids+=("$UP_PID")

mkdir -p "$tmp/storage" "$tmp/xdg-data" "$tmp/xdg-config"
cat >"$tmp/Caddyfile" <<EOF
{
	admin off
	persist_config off
	auto_https off
	storage file_system $tmp/storage
	default_bind 127.0.0.1
	log default {
		output stderr
		level ERROR
	}
	servers {
		timeouts {
			read_header 10s
			read_body 30s
			write 5m
			idle 2m
		}
	}
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
	}
}

# (b) the ceiling: plain reverse_proxy to the upstream
http://:$PROXY_PORT {
	bind 127.0.0.1
	reverse_proxy 127.0.0.1:$UP_PORT
}

# (c) the tunnel: the agent serving app.test
http://:$SLUICE_PORT {
	bind 127.0.0.1
	sluice
}
EOF

XDG_DATA_HOME=$tmp/xdg-data XDG_CONFIG_HOME=$tmp/xdg-config \
	"$CADDY" run --config "$tmp/Caddyfile" --adapter caddyfile >"$tmp/caddy.log" 2>&1 &
CADDY_PID=$!
pids+=("$CADDY_PID")

wait_ok upstream "$DIRECT_URL/" "$UP_PID"
wait_ok caddy "$CADDY_URL/" "$CADDY_PID"

"$tmp/sluice-agent" -server "grpc://127.0.0.1:$CONTROL_PORT" -token "$TOKEN" -id bench \
	-log-level error -upstream "host=$HOST,target=$DIRECT_URL" >"$tmp/agent.log" 2>&1 &
AGENT_PID=$!
pids+=("$AGENT_PID")

wait_ok "sluice-agent (via caddy)" "$SLUICE_URL/" "$AGENT_PID"
log "ready: upstream :$UP_PORT, caddy reverse_proxy :$PROXY_PORT, caddy sluice :$SLUICE_PORT, control :$CONTROL_PORT"

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
# machine_ticks: "busy total" clock ticks of all CPUs (/proc/stat).
machine_ticks() { awk '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t; exit }' /proc/stat; }
# children_ticks: CPU of this script's finished children (curl, wrk): cutime+cstime.
children_ticks() { awk '{ print $16 + $17 }' "/proc/$$/stat"; }
cpu_start() {
	cpu0=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)")
	read -r busy0 total0 < <(machine_ticks)
}
# cpu_stop KEY PATH UNITS SCALE: R[KEY_<process>,PATH] = CPU seconds / UNITS * SCALE
# for the processes PATH goes through.
cpu_stop() {
	local key=$1 p=$2 units=$3 scale=$4 now busy total
	now=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)")
	read -r busy total < <(machine_ticks)
	R[${key}_busy,$p]=$(calc %.0f "100 * ($busy - $busy0) / ($total - $total0 + 1)")
	# busy time of the machine not spent in this bench's processes or clients
	local ours="(${now[2]} - ${cpu0[2]}) + (${now[3]} - ${cpu0[3]})"
	[ "$p" = direct ] || ours+=" + (${now[0]} - ${cpu0[0]})"
	[ "$p" != sluice ] || ours+=" + (${now[1]} - ${cpu0[1]})"
	R[${key}_other,$p]=$(calc %.0f "100 * (($busy - $busy0) - ($ours)) / ($total - $total0 + 1)")
	cpu_set() { R[${key}_$1,$p]=$(calc %.2f "(${now[$2]} - ${cpu0[$2]}) / $CLK_TCK / ($units) * $scale"); }
	case $p in
	caddy) cpu_set caddy 0 ;;
	sluice) cpu_set caddy 0 && cpu_set agent 1 ;;
	esac
	cpu_set upstream 2
}

# ---------------------------------------------------------------- (5) idle keep-alive RSS
# First, while Caddy and the agent are fresh: memory freed by a load is kept
# by the Go runtime and reused, which would hide the cost of new connections.
# The connections through caddy stay open while those through sluice are
# opened, so each batch is measured on fresh memory.

idle_fds=()
idle_pids=()
# idle_open NAME ADDR: opens IDLE_N idle keep-alive connections, returns once they are all up.
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

log "idle keep-alive connections: $IDLE_N via caddy, then $IDLE_N via sluice"
caddy0=$(rss_kib "$CADDY_PID")
agent0=$(rss_kib "$AGENT_PID")
idle_open caddy "127.0.0.1:$PROXY_PORT"
caddy1=$(rss_kib "$CADDY_PID")
idle_open sluice "127.0.0.1:$SLUICE_PORT"
caddy2=$(rss_kib "$CADDY_PID")
agent2=$(rss_kib "$AGENT_PID")
for fd in "${idle_fds[@]}"; do exec {fd}>&-; done
for p in "${idle_pids[@]}"; do wait "$p" || log "idleconns $p exited with $?"; done
R[rss_caddy,caddy]=$(calc %.1f "($caddy1 - $caddy0) / $IDLE_N")
R[rss_caddy,sluice]=$(calc %.1f "($caddy2 - $caddy1) / $IDLE_N")
R[rss_agent,sluice]=$(calc %.1f "($agent2 - $agent0) / $IDLE_N")
RSS_NOTE="caddy RSS ${caddy0} -> ${caddy1} -> ${caddy2} KiB, agent RSS ${agent0} -> ${agent2} KiB"
log "$RSS_NOTE"

# ---------------------------------------------------------------- loads

warnings=()
warn() {
	warnings+=("$*")
	log "WARNING: $*"
}

paths=(direct caddy sluice)
declare -A URL=([direct]=$DIRECT_URL [caddy]=$CADDY_URL [sluice]=$SLUICE_URL)

# (1) one big download
single() {
	local p=$1 out code size t
	cpu_start
	out=$(curl -s -o /dev/null --max-time 300 -H "Host: $HOST" \
		-w '%{http_code} %{size_download} %{time_total}' "${URL[$p]}/download?size=$SINGLE_SIZE" || true)
	read -r code size t <<<"$out"
	if [ "$code" != 200 ] || [ "$size" != "$SINGLE_SIZE" ]; then
		warn "$p: single download: status $code, $size of $SINGLE_SIZE bytes"
	fi
	R[single,$p]=$(calc %.1f "${size:-0} / ${t:-1} / 1e6")
	cpu_stop cpu_single "$p" "${size:-0} + 1" 1e9
}

# (2) PAR_N concurrent downloads, aggregate over the wall time of the batch
parallel() {
	local p=$1 i t0 t1 total=0 code size t cp=()
	t0=$(date +%s.%N)
	for i in $(seq 1 "$PAR_N"); do
		curl -s -o /dev/null --max-time 300 -H "Host: $HOST" \
			-w '%{http_code} %{size_download} %{time_total}' \
			"${URL[$p]}/download?size=$PAR_SIZE" >"$tmp/par.$p.$i" &
		cp+=($!)
	done
	for i in "${cp[@]}"; do wait "$i" || true; done
	t1=$(date +%s.%N)
	for i in $(seq 1 "$PAR_N"); do
		read -r code size t <"$tmp/par.$p.$i" || true
		if [ "${code:-}" != 200 ] || [ "${size:-}" != "$PAR_SIZE" ]; then
			warn "$p: parallel download $i: status ${code:-?}, ${size:-0} of $PAR_SIZE bytes"
		fi
		total=$((total + ${size:-0}))
	done
	R[parallel,$p]=$(calc %.1f "$total / ($t1 - $t0) / 1e6")
}

# (3) small requests with wrk
small() {
	local p=$1 f=$tmp/wrk.$1 v n
	cpu_start
	wrk -t2 -c64 -d"$WRK_DURATION" --latency -H "Host: $HOST" "${URL[$p]}/" >"$f" 2>&1 ||
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

# (4) time to first byte on a fresh connection (one curl process per run)
ttfb() {
	local p=$1 i out code t
	: >"$tmp/ttfb.$p"
	for i in $(seq 1 "$TTFB_RUNS"); do
		out=$(curl -s -o /dev/null --max-time 10 -H "Host: $HOST" \
			-w '%{http_code} %{time_starttransfer}' "${URL[$p]}/" || true)
		read -r code t <<<"$out"
		[ "$code" = 200 ] || warn "$p: ttfb run $i: status $code"
		echo "$t" >>"$tmp/ttfb.$p"
	done
	R[ttfb,$p]=$(sort -g "$tmp/ttfb.$p" | awk '{ v[NR] = $1 } END {
		m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f", m * 1000 }')
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "1. one $((SINGLE_SIZE >> 20)) MiB download"
for p in "${paths[@]}"; do single "$p"; done
log "2. $PAR_N concurrent $((PAR_SIZE >> 20)) MiB downloads"
for p in "${paths[@]}"; do parallel "$p"; done
log "3. wrk -t2 -c64 -d$WRK_DURATION small requests"
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

row() { # row KEY LABEL [noratio]
	local d=${R[$1,direct]:--} c=${R[$1,caddy]:--} s=${R[$1,sluice]:--} rc rd
	rc=$(ratio "$s" "$c")
	rd=$(ratio "$s" "$d")
	[ -z "${3:-}" ] || rc=- rd=-
	printf '%-36s | %10s | %10s | %10s | %12s | %13s\n' "$2" "$d" "$c" "$s" "$rc" "$rd"
}

caddy_version=$("$CADDY" version | awk '{ print $1 }')
echo
echo "sluice HTTP bench ($MODE): $(nproc) CPUs, $(go env GOVERSION), caddy $caddy_version, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "host header $HOST; every process on this machine shares its CPUs (clients included)"
echo "load average before the loads: $LOAD_BEFORE; after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '%-36s | %10s | %10s | %10s | %12s | %13s\n' metric direct caddy sluice sluice/caddy sluice/direct
printf '%s\n' "-------------------------------------+------------+------------+------------+--------------+--------------"
row single "1x $((SINGLE_SIZE >> 20)) MiB download, MB/s"
row parallel "${PAR_N}x $((PAR_SIZE >> 20)) MiB aggregate, MB/s"
row rps "small GET /, requests/s"
row p50 "small GET /, p50 ms (lower=better)"
row p99 "small GET /, p99 ms (lower=better)"
row ttfb "TTFB fresh conn, median ms (lower)"
row rss_caddy "Caddy RSS per idle conn, KiB"
row rss_agent "agent RSS per idle conn, KiB"
printf '%s\n' "-------------------------------------+------------+------------+------------+--------------+--------------"
row cpu_single_caddy "1x download: Caddy CPU s/GB"
row cpu_single_agent "1x download: agent CPU s/GB"
row cpu_single_upstream "1x download: upstream CPU s/GB"
row cpu_single_busy "1x download: machine CPU busy %" noratio
row cpu_single_other "1x download: other processes CPU %" noratio
row cpu_small_caddy "small GET: Caddy CPU us/req"
row cpu_small_agent "small GET: agent CPU us/req"
row cpu_small_upstream "small GET: upstream CPU us/req"
row cpu_small_busy "small GET: machine CPU busy %" noratio
row cpu_small_other "small GET: other processes CPU %" noratio
echo
echo "idle connections: N=$IDLE_N; $RSS_NOTE"
echo "CPU = utime+stime from /proc/<pid>/stat over the load (GB = 10^9 bytes); busy % = all CPUs (/proc/stat);"
echo "other processes = busy time not spent in caddy, agent, upstream or the curl/wrk clients (another load on the machine skews every number)"
echo "MB = 10^6 bytes; wrk -t2 -c64 -d$WRK_DURATION --latency; TTFB = curl time_starttransfer"

target() { # target LABEL KEY MIN
	local r
	r=$(ratio "${R[$2,sluice]:-}" "${R[$2,caddy]:-}")
	if [ "$r" = "-" ]; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "-" "MISS (no data)"
	elif awk "BEGIN { exit !($r >= $3) }"; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" PASS
	else
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" MISS
	fi
}
echo
echo "targets (sluice/caddy; informational):"
target "bulk: single download" single 0.7
target "bulk: ${PAR_N}x parallel downloads" parallel 0.7
target "small requests/s" rps 0.8

if [ "${#warnings[@]}" -gt 0 ]; then
	echo
	echo "warnings:"
	printf '  %s\n' "${warnings[@]}"
fi
exit 0
