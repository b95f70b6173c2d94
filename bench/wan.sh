#!/usr/bin/env bash
# bench/wan.sh: sluice over a long path against a direct connection over the
# same path, with the shared harness (../shared/bench/run.sh, its delayproxy:
# a fixed one-way delay each way and an emulated TCP window). For each round
# trip it runs, in one harness run each, direct_wan (client -> delayproxy ->
# upstream) and sluice_wan (client -> Caddy -> agent; the agent dials the
# node, and so its data lane and direct sockets, through delayproxy):
#
#   - one 256 MiB download, default agent (past 1 MiB on a direct socket);
#   - one 256 MiB download that stays on the data lane
#     (-disable-direct-sockets): one virtual connection's credit window
#     against the path's bandwidth-delay product;
#   - 16 MiB downloads on the lane (a medium transfer: the window's growth
#     is most of it), three in a row, the median: the first runs on a fresh
#     session, which has not measured its round trip yet (so its window
#     starts at 64 KiB), the next two on a warm one (they open with a larger
#     window and grow eightfold per round trip);
#   - the time to first byte of a request on a kept-alive connection (one
#     round trip through the tunnel, not two).
#
# and prints the figures with sluice/direct ratios.
#
#   bench/wan.sh                       # 20, 50 and 100 ms, 6 MiB window, 2 rounds
#   WAN_RTTS="50" WAN_ROUNDS=1 bench/wan.sh
#   HARNESS=/path/to/shared/bench CADDY=/path/to/caddy bench/wan.sh
#
# Needs the harness (its tools: curl, go; see its README). Everything binds
# 127.0.0.1; the harness bounds every wait.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

HARNESS=${HARNESS:-$ROOT/../shared/bench}
[ -x "$HARNESS/run.sh" ] || { log "no harness at $HARNESS (set HARNESS to ../shared/bench)"; exit 1; }
RTTS=${WAN_RTTS:-20 50 100}
WINDOW=${WAN_WINDOW:-6MiB}
WROUNDS=${WAN_ROUNDS:-2}

bench_setup sluice-bench-wan
find_caddy
BIN=$tmp/bin
mkdir -p "$BIN"
cp "$CADDY" "$BIN/caddy-sluice"
go build -o "$BIN/sluice-agent" ./agent/cmd/sluice-agent >"$tmp/build.log" 2>&1 || die "go build sluice-agent"

declare -A W # W[rtt,key,mode]
# harness RTT KEY METRICS BYTES RUNS AGENT_ARGS: one run.sh of direct_wan and sluice_wan.
harness() {
	local rtt=$1 key=$2 metrics=$3 bytes=$4 runs=$5 args=$6 f=$tmp/wan.$1.$2
	BIN=$BIN SCRATCH=$tmp/scratch RESULTS=$f.results WAN_RTT_MS=$rtt WAN_WINDOW=$WINDOW METRICS="$metrics" \
		BULK_BYTES=$bytes BULK_RUNS=$runs ROUNDS=$WROUNDS SLUICE_AGENT_ARGS="$args" \
		timeout 1200 "$HARNESS/run.sh" direct_wan sluice_wan >"$f" 2>&1 || { warn "rtt $rtt $key: harness failed: $(tail -n 3 "$f")"; return 0; }
	local mode metric value
	while read -r mode metric value; do
		case $metric in
		bulk_*) W[$rtt,$key,$mode]=$value ;;
		rtt_keepalive) W[$rtt,ttfb,$mode]=$value ;;
		esac
	done < <(awk '$1 == "md" { print $2, $4, $5 }' "$f")
}

for rtt in $RTTS; do
	log "round trip $rtt ms: 256 MiB (default agent)"
	harness "$rtt" bulk "rtt bulk1" $((256 << 20)) 1 ""
	log "round trip $rtt ms: 256 MiB and 16 MiB on the data lane"
	harness "$rtt" lane bulk1 $((256 << 20)) 1 -disable-direct-sockets
	harness "$rtt" medium bulk1 $((16 << 20)) 3 -disable-direct-sockets
done

echo
echo "sluice WAN bench: $(nproc) CPUs, $(go env GOVERSION), $(date -u +%Y-%m-%dT%H:%M:%SZ); delayproxy window $WINDOW; medians of $WROUNDS rounds"
echo "every process on this machine shares its CPUs (clients included)"
echo
FMT='%-44s | %7s | %9s | %9s | %13s\n'
printf "$FMT" metric "RTT ms" direct sluice sluice/direct
printf '%s\n' "---------------------------------------------+---------+-----------+-----------+--------------"
for rtt in $RTTS; do
	for row in "bulk:256 MiB download, MB/s (direct socket)" "lane:256 MiB download, MB/s (data lane)" \
		"medium:16 MiB download, MB/s (lane, median of 3)" "ttfb:request on a kept-alive conn, ms (lower)"; do
		key=${row%%:*}
		d=${W[$rtt,$key,direct_wan]:--} s=${W[$rtt,$key,sluice_wan]:--}
		printf "$FMT" "${row#*:}" "$rtt" "$d" "$s" "$(ratio "$s" "$d")"
	done
done
echo
echo "targets (sluice/direct, 256 MiB; informational):"
for rtt in $RTTS; do
	for key in bulk lane; do
		r=$(ratio "${W[$rtt,$key,sluice_wan]:-}" "${W[$rtt,$key,direct_wan]:-}")
		verdict=MISS
		[ "$r" != "-" ] && awk "BEGIN { exit !($r >= 0.95) }" && verdict=PASS
		printf '  %-44s >= 0.95  %6s  %s\n' "$rtt ms, $key" "$r" "$verdict"
	done
done
report_warnings
