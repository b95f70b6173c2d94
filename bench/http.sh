#!/usr/bin/env bash
# bench/http.sh: one run, one load, four paths to the same sample upstream:
#
#   direct  curl/wrk -> upstream
#   caddy   curl/wrk -> Caddy reverse_proxy -> upstream   (ceiling of any HTTP path in Caddy)
#   hop     curl/wrk -> Caddy reverse_proxy -> bench/tcprelay -> upstream
#           (what one more process on the path costs by itself: the floor of any tunnel)
#   sluice  curl/wrk -> Caddy `sluice` -> gRPC stream -> sluice-agent -> upstream
#
# and prints a table with sluice/caddy, sluice/hop and sluice/direct ratios plus the
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
# Setup, loads and report helpers shared with bench/tcp.sh: bench/lib.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

if [ "$MODE" = quick ]; then
	PAR_SIZE=$((16 << 20))
else
	PAR_SIZE=$((256 << 20))
fi
PAR_N=8

bench_setup sluice-bench
find_caddy
build_binaries

# ---------------------------------------------------------------- processes

free_ports UP_PORT CONTROL_PORT PROXY_PORT SLUICE_PORT HOP_PORT RELAY_PORT

paths=(direct caddy hop sluice)
declare -A URL=(
	[direct]=http://127.0.0.1:$UP_PORT
	[caddy]=http://127.0.0.1:$PROXY_PORT
	[hop]=http://127.0.0.1:$HOP_PORT
	[sluice]=http://127.0.0.1:$SLUICE_PORT
)
declare -A VIA=([caddy]=caddy [hop]="caddy relay" [sluice]="caddy agent")

start_upstream "127.0.0.1:$UP_PORT"
start_relay "127.0.0.1:$RELAY_PORT" "127.0.0.1:$UP_PORT"

cat >"$tmp/Caddyfile" <<EOF
{
$(caddy_globals)
	default_bind 127.0.0.1
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

# (hop) the ceiling plus one bare relay process: what any tunnel pays at least
http://:$HOP_PORT {
	bind 127.0.0.1
	reverse_proxy 127.0.0.1:$RELAY_PORT
}

# (c) the tunnel: the agent serving app.test
http://:$SLUICE_PORT {
	bind 127.0.0.1
	sluice
}
EOF
start_caddy

wait_ok upstream "${URL[direct]}/" "$UP_PID"
wait_ok caddy "${URL[caddy]}/" "$CADDY_PID"
wait_ok "relay (via caddy)" "${URL[hop]}/" "$RELAY_PID"

start_agent -upstream "host=$HOST,target=${URL[direct]}"

wait_ok "sluice-agent (via caddy)" "${URL[sluice]}/" "$AGENT_PID"
log "ready: upstream :$UP_PORT, caddy reverse_proxy :$PROXY_PORT, via relay :$HOP_PORT, caddy sluice :$SLUICE_PORT, control :$CONTROL_PORT"

# cpu_other KEY PATH (for cpu_stop): busy time of the machine not spent in
# this bench's processes or clients
cpu_other() {
	local ours="(${now[2]} - ${cpu0[2]}) + (${now[3]} - ${cpu0[3]})"
	[ "$2" = direct ] || ours+=" + (${now[0]} - ${cpu0[0]})"
	[ "$2" != sluice ] || ours+=" + (${now[1]} - ${cpu0[1]})"
	[ "$2" != hop ] || ours+=" + (${now[4]} - ${cpu0[4]})"
	R[${1}_other,$2]=$(calc %.0f "100 * (($busy - $busy0) - ($ours)) / ($total - $total0 + 1)")
}

# ---------------------------------------------------------------- (5) idle keep-alive RSS
# (idle_batches in bench/lib.sh) The connections through caddy stay open
# while those through sluice are opened.

log "idle keep-alive connections: $IDLE_N via caddy, then $IDLE_N via sluice"
idle_batches caddy "127.0.0.1:$PROXY_PORT" sluice "127.0.0.1:$SLUICE_PORT"
R[rss_caddy,caddy]=$(per_conn "${caddy_rss[1]}" "${caddy_rss[0]}")
R[rss_caddy,sluice]=$(per_conn "${caddy_rss[2]}" "${caddy_rss[1]}")
R[rss_agent,sluice]=$(per_conn "${agent_rss[2]}" "${agent_rss[0]}")
RSS_NOTE="caddy RSS ${caddy_rss[0]} -> ${caddy_rss[1]} -> ${caddy_rss[2]} KiB, agent RSS ${agent_rss[0]} -> ${agent_rss[2]} KiB"
log "$RSS_NOTE"

# ---------------------------------------------------------------- loads
# (1) single, (3) small and (4) ttfb are in bench/lib.sh.

# (2) PAR_N concurrent downloads, aggregate over the wall time of the batch
parallel() {
	local p=$1 i t0 t1 total=0 code size t cp=()
	cpu_start
	t0=$(date +%s.%N)
	for i in $(seq 1 "$PAR_N"); do
		"${PIN_PUBLIC[@]}" curl -s -o /dev/null --max-time 300 -H "Host: $HOST" \
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
	cpu_stop cpu_par "$p" "$total + 1" 1e9
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "1. one $((SINGLE_SIZE >> 20)) MiB download"
each_path single
log "2. $PAR_N concurrent $((PAR_SIZE >> 20)) MiB downloads"
each_path parallel
log "3. wrk -t2 -c64 -d$WRK_DURATION small requests"
each_path small
log "4. time to first byte, median of $TTFB_RUNS fresh connections"
each_path ttfb

# ---------------------------------------------------------------- report

FMT='%-36s | %9s | %9s | %9s | %9s | %12s | %10s | %13s\n'
SEP="-------------------------------------+-----------+-----------+-----------+-----------+--------------+------------+--------------"
COLUMNS=(direct caddy hop sluice sluice/caddy sluice/hop sluice/direct)
BASE=caddy

report_header HTTP "host header $HOST; $SHARING"
printf "$FMT" metric direct caddy hop sluice sluice/caddy sluice/hop sluice/direct
sep
row single "1x $((SINGLE_SIZE >> 20)) MiB download, MB/s"
row parallel "${PAR_N}x $((PAR_SIZE >> 20)) MiB aggregate, MB/s"
rows_requests
sep
rows_cpu cpu_single "1x download" s/GB
rows_cpu cpu_par "${PAR_N}x downloads" s/GB
rows_cpu cpu_small "small GET" us/req
echo
echo "idle connections: N=$IDLE_N; $RSS_NOTE"
echo "CPU = utime+stime from /proc/<pid>/stat over the load (GB = 10^9 bytes); busy % = all CPUs (/proc/stat);"
echo "other processes = busy time not spent in caddy, agent, relay, upstream or the curl/wrk clients (another load on the machine skews every number)"
echo "hop = caddy reverse_proxy -> bench/tcprelay (a bare 256 KiB read/write loop each way) -> upstream: the cost of one more process on the path alone"
echo "MB = 10^6 bytes; wrk -t2 -c64 -d$WRK_DURATION --latency; TTFB = curl time_starttransfer"

echo
echo "targets (sluice/caddy; informational${PIN_PUBLIC:+; set for shared CPUs, this run is pinned as two hosts}):"
target "bulk: single download" single 0.9 sluice
target "bulk: ${PAR_N}x parallel downloads" parallel 0.9 sluice
target "small requests/s" rps 0.95 sluice
echo "reference (hop/caddy: what one more process costs by itself on this machine):"
reference "bulk: single download" single
reference "bulk: ${PAR_N}x parallel downloads" parallel
reference "small requests/s" rps

report_warnings
exit 0
