#!/usr/bin/env bash
# bench/tcp.sh: one run, one load, the raw TCP path five ways to the same
# sample upstream (an HTTP server, so HTTP loads run over the TCP relays):
#
#   direct  curl/wrk -> upstream
#   l4      curl/wrk -> caddy-l4 `proxy` -> upstream         (ceiling of any TCP path in Caddy)
#   hop     curl/wrk -> caddy-l4 `proxy` -> bench/tcprelay -> upstream
#           (what one more process on the path costs by itself: the floor of any tunnel)
#   sluice  curl/wrk -> caddy-l4 `sluice bench` -> gRPC stream -> sluice-agent -> upstream
#   port    curl/wrk -> port claimed by the agent (tcp_port_range) -> gRPC stream -> agent -> upstream
#
# and prints a table with sluice/l4, sluice/hop, sluice/direct and port/l4 ratios plus
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
# Setup, loads and report helpers shared with bench/http.sh: bench/lib.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

ROUTE=bench

bench_setup sluice-bench-tcp
find_caddy
modules=$("$CADDY" list-modules 2>/dev/null) || die "$CADDY list-modules failed"
for m in layer4.handlers.proxy layer4.handlers.sluice; do
	grep -qx "$m" <<<"$modules" || die "$CADDY has no $m module (build it with ./xcaddy.sh)"
done
build_binaries

# ---------------------------------------------------------------- processes

free_ports UP_PORT CONTROL_PORT L4_PORT SLUICE_PORT CLAIM_PORT HOP_PORT RELAY_PORT

paths=(direct l4 hop sluice port)
declare -A ADDR=(
	[direct]=127.0.0.1:$UP_PORT
	[l4]=127.0.0.1:$L4_PORT
	[hop]=127.0.0.1:$HOP_PORT
	[sluice]=127.0.0.1:$SLUICE_PORT
	[port]=127.0.0.1:$CLAIM_PORT
)
declare -A URL
for p in "${paths[@]}"; do URL[$p]=http://${ADDR[$p]}; done
declare -A VIA=([l4]=caddy [hop]="caddy relay" [sluice]="caddy agent" [port]="caddy agent")

start_upstream "${ADDR[direct]}"
start_relay "127.0.0.1:$RELAY_PORT" "${ADDR[direct]}"

cat >"$tmp/Caddyfile" <<EOF
{
$(caddy_globals)
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
		# (hop) the ceiling plus one bare relay process: what any tunnel pays at least
		127.0.0.1:$HOP_PORT {
			route {
				proxy 127.0.0.1:$RELAY_PORT
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
start_caddy

wait_ok upstream "${URL[direct]}/" "$UP_PID"
wait_ok "caddy (l4 proxy)" "${URL[l4]}/" "$CADDY_PID"
wait_ok "relay (via l4 proxy)" "${URL[hop]}/" "$RELAY_PID"

start_agent -upstream "name=$ROUTE,target=tcp://${ADDR[direct]}" \
	-upstream "listen_port=$CLAIM_PORT,target=tcp://${ADDR[direct]}"

wait_ok "sluice-agent (via caddy-l4 sluice)" "${URL[sluice]}/" "$AGENT_PID"
wait_ok "sluice-agent (via claimed port)" "${URL[port]}/" "$AGENT_PID"
log "ready: upstream :$UP_PORT, l4 proxy :$L4_PORT, via relay :$HOP_PORT, l4 sluice :$SLUICE_PORT, claimed port :$CLAIM_PORT, control :$CONTROL_PORT"

# cpu_other KEY PATH (for cpu_stop): R[KEY_irq,PATH] and the busy time of the
# machine not spent in this bench's processes, its clients or interrupts
# (clamped at 0: a client's ticks land at its exit)
cpu_other() {
	R[${1}_irq,$2]=$(calc %.0f "100 * ($irq - $irq0) / ($total - $total0 + 1)")
	local ours="(${now[0]} - ${cpu0[0]}) + (${now[1]} - ${cpu0[1]}) + (${now[2]} - ${cpu0[2]}) + (${now[3]} - ${cpu0[3]}) + (${now[4]} - ${cpu0[4]}) + ($irq - $irq0)"
	R[${1}_other,$2]=$(calc %.0f "100 * ((o = ($busy - $busy0) - ($ours)) > 0 ? o : 0) / ($total - $total0 + 1)")
}

# ---------------------------------------------------------------- (3) idle connection RSS
# (idle_batches in bench/lib.sh) idleconns sends one keep-alive GET per
# connection (HTTP over the raw relay) and holds the connection idle; every
# relayed connection stays open end to end (client - Caddy - [agent] - upstream).

log "3. idle connections (first, while the processes are fresh): $IDLE_N via l4 proxy, then $IDLE_N via l4 sluice, then $IDLE_N via the claimed port"
idle_batches l4 "${ADDR[l4]}" sluice "${ADDR[sluice]}" port "${ADDR[port]}"
R[rss_caddy,l4]=$(per_conn "${caddy_rss[1]}" "${caddy_rss[0]}")
R[rss_caddy,sluice]=$(per_conn "${caddy_rss[2]}" "${caddy_rss[1]}")
R[rss_agent,sluice]=$(per_conn "${agent_rss[2]}" "${agent_rss[1]}")
R[rss_caddy,port]=$(per_conn "${caddy_rss[3]}" "${caddy_rss[2]}")
R[rss_agent,port]=$(per_conn "${agent_rss[3]}" "${agent_rss[2]}")
RSS_NOTE="caddy RSS ${caddy_rss[0]} -> ${caddy_rss[1]} -> ${caddy_rss[2]} -> ${caddy_rss[3]} KiB, agent RSS ${agent_rss[0]} -> ${agent_rss[1]} -> ${agent_rss[2]} -> ${agent_rss[3]} KiB"
log "$RSS_NOTE"

# ---------------------------------------------------------------- loads
# (1) single, (2) small and (4) ttfb are in bench/lib.sh.

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "1. one $((SINGLE_SIZE >> 20)) MiB download"
each_path single
log "2. wrk -t2 -c64 -d$WRK_DURATION small requests"
each_path small
log "4. time to first byte, median of $TTFB_RUNS fresh connections"
each_path ttfb

# ---------------------------------------------------------------- report

FMT='%-36s | %9s | %9s | %9s | %9s | %9s | %10s | %13s | %9s | %7s\n'
SEP="-------------------------------------+-----------+-----------+-----------+-----------+-----------+------------+---------------+-----------+--------"
COLUMNS=(direct l4 hop sluice sluice/l4 sluice/hop sluice/direct port port/l4)
BASE=l4
CPU_IRQ=1

report_header TCP "HTTP/1.1 (Host $HOST) over raw TCP relays; $SHARING"
printf "$FMT" metric direct "l4 proxy" hop sluice sluice/l4 sluice/hop sluice/direct "(d) port" port/l4
sep
row single "1x $((SINGLE_SIZE >> 20)) MiB download, MB/s"
rows_requests
sep
rows_cpu cpu_single "1x download" s/GB
rows_cpu cpu_small "small GET" us/req
echo
echo "columns: l4 proxy = caddy-l4 proxy; hop = caddy-l4 proxy -> bench/tcprelay (a bare 256 KiB read/write loop each way)"
echo "-> upstream, the cost of one more process on the path alone; sluice = caddy-l4 'sluice $ROUTE' (named agent route);"
echo "(d) port = sluice listen-port route: port $CLAIM_PORT claimed by the agent (listen_port, tcp_port_range) in the sluice app"
echo "idle connections: N=$IDLE_N per path, held together; $RSS_NOTE"
echo "CPU = utime+stime from /proc/<pid>/stat over the load (GB = 10^9 bytes); busy %, irq+softirq % = all CPUs (/proc/stat;"
echo "irq+softirq is mostly loopback packet processing, charged to no process); other processes = busy time not spent in"
echo "caddy, agent, relay, upstream, the curl/wrk clients or interrupts (another load on the machine skews every number)"
echo "MB = 10^6 bytes; wrk -t2 -c64 -d$WRK_DURATION --latency; TTFB = curl time_starttransfer"

echo
echo "targets (sluice/l4; informational${PIN_PUBLIC:+; set for shared CPUs, this run is pinned as two hosts}):"
target "bulk: single download MB/s" single 1.0 sluice
target "small requests/s" rps 0.85 sluice
target "(d) port route: bulk, single download MB/s" single 1.0 port
target "(d) port route: small requests/s" rps 0.85 port
echo "reference (hop/l4: what one more process costs by itself on this machine):"
reference "bulk: single download MB/s" single
reference "small requests/s" rps

report_warnings
exit 0
