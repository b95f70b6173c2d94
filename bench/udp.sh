#!/usr/bin/env bash
# bench/udp.sh: one run, UDP four ways to the same upstreams (dnsmasq as a
# DNS resolver, an iperf3 server):
#
#   direct  dnsperf/iperf3 -> upstream
#   sluice  -> caddy-l4 UDP server `sluice NAME` -> datagram flows -> sluice-agent -> upstream
#   port    -> UDP port the node binds for the agent's listen_port route (udp_port_range)
#              -> datagram flows -> sluice-agent -> upstream
#   frp     -> frps UDP proxy (remotePort) -> frpc -> upstream   (frp's UDP proxy, TLS off)
#
# Loads, each path in turn:
#   1. dnsperf: DNS_QUERIES A queries (1000 names), 50 client sockets, 50 outstanding:
#      queries/s, p50 and p99 latency (dnsperf -v, every answer), lost
#   2. iperf3 -u at each of RATES, 1400-byte datagrams, IPERF_SECS seconds:
#      Mbit/s received, loss %, jitter (iperf3's control connection goes
#      through the same path's TCP twin: a layer4 TCP server, a claimed TCP
#      port, an frp tcp proxy, on the same port number)
#   3. CPU seconds of the tunnel's processes (caddy + agent, frps + frpc)
#      during the iperf3 run at the top rate
#
#   bench/udp.sh                  # full run (50000 queries; 100M 500M 1G for 10 s)
#   BENCH_QUICK=1 bench/udp.sh    # quick run (10000 queries; 100M 500M for 3 s)
#   CADDY=/path/to/caddy bench/udp.sh
#   FRPS=... FRPC=... bench/udp.sh  # frp binaries; default $BIN/frps, $BIN/frpc
#                                   # (BIN=${TMPDIR:-/tmp}/bench/bin, where
#                                   # ../shared/bench/install-tools.sh builds them);
#                                   # without them the frp column is left out
#
# Needs dnsmasq, dnsperf, iperf3 (Debian: dnsmasq-base dnsperf iperf3) and
# what bench/lib.sh needs. Everything binds 127.0.0.1; every wait is
# bounded. The figures are informational: the exit status is non-zero only
# when the setup fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

if [ "$MODE" = quick ]; then
	DNS_QUERIES=${DNS_QUERIES:-10000}
	RATES=${RATES:-"100M 500M"}
	IPERF_SECS=${IPERF_SECS:-3}
else
	DNS_QUERIES=${DNS_QUERIES:-50000}
	RATES=${RATES:-"100M 500M 1G"}
	IPERF_SECS=${IPERF_SECS:-10}
fi
DNS_CONC=50
IPERF_LEN=1400
BIN=${BIN:-${TMPDIR:-/tmp}/bench/bin}
FRPS=${FRPS:-$BIN/frps}
FRPC=${FRPC:-$BIN/frpc}

bench_setup sluice-bench-udp
for tool in dnsmasq dnsperf iperf3; do
	command -v "$tool" >/dev/null 2>&1 || die "$tool is required (Debian: dnsmasq-base dnsperf iperf3)"
done
find_caddy
modules=$("$CADDY" list-modules 2>/dev/null) || die "$CADDY list-modules failed"
grep -qx layer4.handlers.sluice <<<"$modules" || die "$CADDY has no layer4.handlers.sluice (build it with ./xcaddy.sh)"
build_binaries

paths=(direct sluice port)
if [ -x "$FRPS" ] && [ -x "$FRPC" ]; then
	paths+=(frp)
else
	log "no frps/frpc at $FRPS, $FRPC (../shared/bench/install-tools.sh builds them): the frp column is left out"
fi

# ---------------------------------------------------------------- processes

# Each port number below is free for TCP and UDP: iperf3 takes both.
read -r DNS_PORT IPERF_PORT CONTROL_PORT L4_DNS L4_IPERF FRPS_PORT FRP_DNS FRP_IPERF \
	<<<"$("$tmp/freeports" -n 8 -udp | tr '\n' ' ')"
[ -n "$FRP_IPERF" ] || die "freeports returned too few ports"
# The node's UDP port range is one range: two ports in a row.
read -r PORT_DNS PORT_IPERF <<<"$("$tmp/freeports" -n 2 -udp -consecutive | tr '\n' ' ')"
[ -n "$PORT_IPERF" ] || die "freeports returned too few ports"
declare -A DNS=([direct]=$DNS_PORT [sluice]=$L4_DNS [port]=$PORT_DNS [frp]=$FRP_DNS)
declare -A IPERF=([direct]=$IPERF_PORT [sluice]=$L4_IPERF [port]=$PORT_IPERF [frp]=$FRP_IPERF)
declare -A VIA=([sluice]="caddy agent" [port]="caddy agent" [frp]="frps frpc")

"${PIN_PRIVATE[@]}" dnsmasq --no-daemon --conf-file=/dev/null --no-resolv --no-hosts --no-poll \
	--listen-address=127.0.0.1 --bind-interfaces --port="$DNS_PORT" --cache-size=10000 \
	--pid-file= --user="$(id -un)" --log-facility=- --address=/bench.example.test/192.0.2.99 \
	>"$tmp/dnsmasq.log" 2>&1 &
DNSMASQ_PID=$!
pids+=("$DNSMASQ_PID")
"${PIN_PRIVATE[@]}" iperf3 -s -B 127.0.0.1 -p "$IPERF_PORT" >"$tmp/iperf3.log" 2>&1 &
UP_PID=$!
pids+=("$UP_PID")

cat >"$tmp/Caddyfile" <<EOF
{
$(caddy_globals)
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
		# (port) the agent claims these for its listen-port routes: UDP for
		# DNS and iperf3's datagrams, TCP for iperf3's control connection
		udp_port_range $PORT_DNS-$PORT_IPERF
		udp_bind 127.0.0.1
		tcp_port_range $PORT_IPERF-$PORT_IPERF
		tcp_bind 127.0.0.1
	}
	layer4 {
		# (sluice) named routes of the agent
		udp/127.0.0.1:$L4_DNS {
			route {
				sluice dns
			}
		}
		udp/127.0.0.1:$L4_IPERF {
			route {
				sluice iperf
			}
		}
		127.0.0.1:$L4_IPERF {
			route {
				sluice iperf-control
			}
		}
	}
}
EOF
start_caddy
start_agent -upstream "name=dns,target=udp://127.0.0.1:$DNS_PORT" \
	-upstream "name=iperf,target=udp://127.0.0.1:$IPERF_PORT" \
	-upstream "name=iperf-control,target=tcp://127.0.0.1:$IPERF_PORT" \
	-upstream "name=dns-port,listen_port=$PORT_DNS,target=udp://127.0.0.1:$DNS_PORT" \
	-upstream "name=iperf-port,listen_port=$PORT_IPERF,target=udp://127.0.0.1:$IPERF_PORT" \
	-upstream "name=iperf-control-port,listen_port=$PORT_IPERF,target=tcp://127.0.0.1:$IPERF_PORT"

if [[ " ${paths[*]} " == *" frp "* ]]; then
	cat >"$tmp/frps.toml" <<EOF
bindAddr = "127.0.0.1"
bindPort = $FRPS_PORT
proxyBindAddr = "127.0.0.1"
auth.token = "$TOKEN"
transport.tls.force = false
EOF
	cat >"$tmp/frpc.toml" <<EOF
serverAddr = "127.0.0.1"
serverPort = $FRPS_PORT
auth.token = "$TOKEN"
transport.tls.enable = false
loginFailExit = false

[[proxies]]
name = "dns"
type = "udp"
localIP = "127.0.0.1"
localPort = $DNS_PORT
remotePort = $FRP_DNS

[[proxies]]
name = "iperf"
type = "udp"
localIP = "127.0.0.1"
localPort = $IPERF_PORT
remotePort = $FRP_IPERF

[[proxies]]
name = "iperf-control"
type = "tcp"
localIP = "127.0.0.1"
localPort = $IPERF_PORT
remotePort = $FRP_IPERF
EOF
	"${PIN_PUBLIC[@]}" "$FRPS" -c "$tmp/frps.toml" >"$tmp/frps.log" 2>&1 &
	FRPS_PID=$!
	pids+=("$FRPS_PID")
	"${PIN_PRIVATE[@]}" "$FRPC" -c "$tmp/frpc.toml" >"$tmp/frpc.log" 2>&1 &
	FRPC_PID=$!
	pids+=("$FRPC_PID")
fi

# dns_ok PORT: one query answered with the record.
dns_ok() {
	local out
	out=$(dnsperf -s 127.0.0.1 -p "$1" -d <(echo "ready.bench.example.test A") -n 1 -t 1 2>/dev/null) || return 1
	grep -q 'Queries completed:[[:space:]]*1 ' <<<"$out"
}

# wait_dns NAME PATH PID: poll the path's DNS port until it answers.
wait_dns() {
	local end=$((SECONDS + READY_TIMEOUT))
	until dns_ok "${DNS[$2]}"; do
		kill -0 "$3" 2>/dev/null || die "$1 exited"
		[ "$SECONDS" -lt "$end" ] || die "$1: no DNS answer on port ${DNS[$2]} after ${READY_TIMEOUT}s"
		sleep 0.1
	done
}

# wait_iperf NAME PATH PID: poll the path's iperf3 port until a short UDP
# test completes.
wait_iperf() {
	local end=$((SECONDS + READY_TIMEOUT))
	until iperf3 -c 127.0.0.1 -p "${IPERF[$2]}" -u -b 1M -t 1 -l "$IPERF_LEN" >/dev/null 2>&1; do
		kill -0 "$3" 2>/dev/null || die "$1 exited"
		[ "$SECONDS" -lt "$end" ] || die "$1: iperf3 via port ${IPERF[$2]} not working after ${READY_TIMEOUT}s"
		sleep 0.2
	done
}

wait_dns dnsmasq direct "$DNSMASQ_PID"
wait_iperf iperf3 direct "$UP_PID"
wait_dns "sluice (layer4 UDP)" sluice "$AGENT_PID"
wait_dns "sluice (claimed port)" port "$AGENT_PID"
wait_iperf "sluice (layer4 UDP)" sluice "$AGENT_PID"
wait_iperf "sluice (claimed port)" port "$AGENT_PID"
if [ -n "${FRPC_PID:-}" ]; then
	wait_dns frp frp "$FRPC_PID"
	wait_iperf frp frp "$FRPC_PID"
fi
log "ready: dnsmasq :$DNS_PORT, iperf3 :$IPERF_PORT; sluice layer4 :$L4_DNS/:$L4_IPERF, claimed :$PORT_DNS/:$PORT_IPERF${FRPC_PID:+, frp :$FRP_DNS/:$FRP_IPERF}"

# ---------------------------------------------------------------- loads

# tunnel_ticks PATH: CPU clock ticks so far of the processes PATH goes through.
tunnel_ticks() {
	case $1 in
	sluice | port) echo $(($(cpu_ticks "$CADDY_PID") + $(cpu_ticks "$AGENT_PID"))) ;;
	frp) echo $(($(cpu_ticks "$FRPS_PID") + $(cpu_ticks "$FRPC_PID"))) ;;
	*) echo 0 ;;
	esac
}

# dns PATH: dnsperf through PATH; R[qps|p50|p99|lost,PATH].
dns() {
	local p=$1 out
	out=$("${PIN_PUBLIC[@]}" dnsperf -s 127.0.0.1 -p "${DNS[$p]}" -d "$tmp/queries" -n $((DNS_QUERIES / 1000)) \
		-c "$DNS_CONC" -q "$DNS_CONC" -t 5 -v 2>"$tmp/dnsperf.$p.log") || die "dnsperf via $p failed: $(cat "$tmp/dnsperf.$p.log")"
	R[qps,$p]=$(awk '/Queries per second:/ { printf "%.0f", $4 }' <<<"$out")
	R[lost,$p]=$(awk '/Queries lost:/ { print $3 }' <<<"$out")
	read -r R[p50,$p] R[p99,$p] < <(awk '$1 == ">" { print $5 * 1000 }' <<<"$out" | sort -n |
		awk '{ v[NR] = $1 } END { if (NR == 0) { print "- -"; exit }
			i50 = int(NR * 0.50 + 0.999); i99 = int(NR * 0.99 + 0.999)
			printf "%.3f %.3f\n", v[i50], v[i99] }')
}

# iperf_udp PATH RATE: one iperf3 -u run through PATH; its output.
iperf_udp() {
	"${PIN_PUBLIC[@]}" iperf3 -c 127.0.0.1 -p "${IPERF[$1]}" -u -b "$2" -t "$IPERF_SECS" -l "$IPERF_LEN" -w 4M 2>&1
}

# udp_rate PATH: iperf3 -u through PATH at each rate; R[mbps_RATE|loss_RATE|jitter_RATE,PATH],
# and R[cpu,PATH], the tunnel's CPU seconds at the top rate.
udp_rate() {
	local p=$1 rate out line t0
	for rate in $RATES; do
		t0=$(tunnel_ticks "$p")
		# iperf3 3.12 now and then gives up on its control connection
		# (EAGAIN reading the results) on a loaded machine: one retry.
		out=$(iperf_udp "$p" "$rate") || out=$(iperf_udp "$p" "$rate") ||
			{ warn "iperf3 -b $rate via $p failed: $(tail -n 3 <<<"$out")"; continue; }
		line=$(grep ' receiver$' <<<"$out" | tail -n 1)
		# [  5]   0.00-3.00   sec  35.7 MBytes  99.9 Mbits/sec  0.004 ms  0/26780 (0%)  receiver
		R[mbps_$rate,$p]=$(awk '{ for (i = 1; i <= NF; i++) if ($i ~ /bits\/sec$/) {
			v = $(i - 1); u = $i
			if (u ~ /^G/) v *= 1000; else if (u ~ /^K/) v /= 1000; else if (u !~ /^M/) v /= 1e6
			printf "%.0f", v; exit } }' <<<"$line")
		R[jitter_$rate,$p]=$(awk '{ for (i = 1; i <= NF; i++) if ($i == "ms") { printf "%.3f", $(i - 1); exit } }' <<<"$line")
		R[loss_$rate,$p]=$(awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\(.*%\)$/) { v = $i; gsub(/[()%]/, "", v); printf "%.2f", v; exit } }' <<<"$line")
		[ "$p" = direct ] || R[cpu,$p]=$(calc %.2f "($(tunnel_ticks "$p") - $t0) / $CLK_TCK")
	done
}

for ((i = 0; i < 1000; i++)); do echo "q$i.bench.example.test A"; done >"$tmp/queries"

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "1. dnsperf: $DNS_QUERIES queries, $DNS_CONC sockets, $DNS_CONC outstanding"
each_path dns
log "2. iperf3 -u at $RATES, ${IPERF_LEN}-byte datagrams, ${IPERF_SECS}s each"
each_path udp_rate

# ---------------------------------------------------------------- report

col() { printf '%10s |' "$@"; }
line() { # line LABEL KEY
	local p
	printf '%-40s |' "$1"
	for p in "${paths[@]}"; do col "${R[$2,$p]:--}"; done
	echo
}
sep() { printf '%s\n' "-----------------------------------------+$(for p in "${paths[@]}"; do printf -- '-----------+'; done)"; }

echo "UDP ($MODE): $SHARING; $(nproc) CPUs; load before $LOAD_BEFORE, after $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-40s |' metric
for p in "${paths[@]}"; do col "$p"; done
echo
sep
line "dnsperf queries/s" qps
line "dnsperf p50 latency, ms (lower)" p50
line "dnsperf p99 latency, ms (lower)" p99
line "dnsperf queries lost of $DNS_QUERIES" lost
sep
for rate in $RATES; do
	line "iperf3 -u -b $rate: received Mbit/s" "mbps_$rate"
	line "iperf3 -u -b $rate: loss %" "loss_$rate"
	line "iperf3 -u -b $rate: jitter ms" "jitter_$rate"
done
sep
line "tunnel CPU s, iperf3 at ${RATES##* } for ${IPERF_SECS}s" cpu
echo
echo "paths: sluice = caddy-l4 UDP server 'sluice dns' / 'sluice iperf' (named routes); port = UDP ports the node binds for"
echo "the agent's listen_port routes (udp_port_range); frp = frps UDP proxy <- frpc (transport TLS off, as sluice's grpc://)."
echo "dnsperf -c $DNS_CONC -q $DNS_CONC: latency percentiles over every answered query (dnsperf -v); p50/p99 added by the"
echo "tunnel = path minus direct. iperf3: receiver's figures; control connection through the path's TCP twin; -w 4M."
echo "tunnel CPU = utime+stime of caddy + sluice-agent (or frps + frpc) during the last iperf3 run."
report_warnings
exit 0
