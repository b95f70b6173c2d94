#!/usr/bin/env bash
# bench/scale.sh: one sluice node under N agents. Starts one Caddy (the
# xcaddy build, everything on 127.0.0.1) and runs bench/scale, which runs N
# agents in its own process (each advertising two hosts, one shared tiny
# upstream), and measures: the time until all N are connected, the node's
# RSS, Go heap and goroutines per idle session (and the agents' own memory,
# apart), one Advertise of 1,000 routes against one of 1 (on the empty node
# and at N sessions), and a reconnection storm: the node restarted under all
# N agents (how long until all are back, the spread of their reconnects,
# the new node's peak RSS, and a probe through the node's HTTP port every
# 100 ms). It does this twice, with the data lane on and off (each with a
# fresh node), and prints both runs' reports, a table of the figures and
# the node's heap by allocation site per idle session.
#
#   bench/scale.sh                     # N=10000, lane on and off: several minutes
#   SCALE_N=1000 bench/scale.sh        # quick
#   SCALE_LANES=on bench/scale.sh      # one run only (on, off or "on off")
#   SCALE_STORM=0 bench/scale.sh       # no restart
#   SCALE_STORM_SIGNAL=KILL bench/scale.sh   # a crash rather than a graceful stop
#   SCALE_CONNECT_WINDOW=16 bench/scale.sh   # agents connecting at once at the start (default 16;
#                                            # 0: all N at once, or SCALE_LAUNCH_RATE a second)
#   SCALE_CONNECT_TIMEOUT=35m bench/scale.sh # how long connecting all N may take (default 10m + N/400 min)
#   SCALE_STORM_TIMEOUT=5m bench/scale.sh    # how long the storm may take (default 5m)
#   SCALE_ADV_REPS=5 bench/scale.sh    # Advertise measurements of each size (default 5)
#   SCALE_OUT=/some/dir bench/scale.sh # keep the reports, results and profiles there
#   CADDY=/path/to/caddy bench/scale.sh
#
# Caddy runs under a supervisor loop (at most 3 starts, as a service manager
# restarts a node that exits) with `caddy run --pidfile`; bench/scale
# signals it for the storm. The limits that N sessions from one address
# would hit are raised: max_sessions, max_pending_streams and
# max_pending_streams_per_address to N + 256, and the fd limit (ulimit -n,
# both processes) to 4N + 4096. Every wait is bounded; the EXIT trap stops
# every process. Needs go and curl.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

N=${SCALE_N:-10000}
LANES=${SCALE_LANES:-on off}
STORM=${SCALE_STORM:-1}
STORM_SIGNAL=${SCALE_STORM_SIGNAL:-TERM}
LAUNCH_RATE=${SCALE_LAUNCH_RATE:-0}
CONNECT_WINDOW=${SCALE_CONNECT_WINDOW:-16}
CONNECT_TIMEOUT=${SCALE_CONNECT_TIMEOUT:-$((10 + N / 400))m}
STORM_TIMEOUT=${SCALE_STORM_TIMEOUT:-5m}
ADV_REPS=${SCALE_ADV_REPS:-5}
DEADLINE_MIN=$((30 + N / 200)) # bench/scale's bound on one run, minutes
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { log "SCALE_N must be a positive integer, not '$N'"; exit 1; }
for l in $LANES; do
	case $l in on | off) ;; *) log "SCALE_LANES: on and/or off, not '$l'"; exit 1 ;; esac
done

for tool in go curl timeout; do
	command -v "$tool" >/dev/null 2>&1 || { log "$tool is required"; exit 1; }
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sluice-scale.XXXXXX")
pids=()

# stop_node: ends the supervisor loop and the Caddy it runs (bounded).
stop_node() {
	local p i
	[ -n "${tmp:-}" ] || return 0
	touch "$tmp/stop"
	p=$(cat "$tmp/caddy.pid" 2>/dev/null || true)
	if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then
		kill -TERM "$p" 2>/dev/null || true
		for i in $(seq 1 300); do # up to 30 s: the node drains N sessions
			kill -0 "$p" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$p" 2>/dev/null || true
	fi
	if [ -n "${SUP_PID:-}" ]; then
		for i in $(seq 1 50); do
			kill -0 "$SUP_PID" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$SUP_PID" 2>/dev/null || true
		wait "$SUP_PID" 2>/dev/null || true
		SUP_PID=
	fi
	rm -f "$tmp/stop" "$tmp/caddy.pid"
}
scale_cleanup() {
	local status=$?
	set +e
	stop_node
	(exit "$status") # cleanup (bench/lib.sh) takes the status from $?
	cleanup
}
trap scale_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The fd limit: each agent holds a gRPC connection and, with the lane, a
# data lane, at both ends (the agents' process and the node), plus some to
# spare: 2N + 1024 per process with the lane, N + 1024 without. Raised to
# 4N + 4096 where this shell may (root with CAP_SYS_RESOURCE, or the hard
# limit allows); where it may not, a run that would not fit has its N
# lowered to what does (a multiple of 500), and the report says so.
NOFILE=$((4 * N + 4096))
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$NOFILE" ]; then
	ulimit -n "$NOFILE" 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fi
FD_LIMIT=$(ulimit -n)
[ "$FD_LIMIT" != unlimited ] || FD_LIMIT=$NOFILE
declare -A N_OF
for l in $LANES; do
	per=1
	[ "$l" = off ] || per=2
	N_OF[$l]=$N
	if [ $((per * N + 1024)) -gt "$FD_LIMIT" ]; then
		N_OF[$l]=$(((FD_LIMIT - 1024) / per / 500 * 500))
		[ "${N_OF[$l]}" -gt 0 ] || die "the fd limit $FD_LIMIT (hard $(ulimit -Hn)) leaves no room for agents"
		log "NOTE: data lane $l: N lowered from $N to ${N_OF[$l]}: the fd limit is $FD_LIMIT (hard $(ulimit -Hn)) and this run needs $per fds per agent in each process"
	fi
done

find_caddy
log "building bench/scale"
go build -o "$tmp/scale" ./bench/scale >"$tmp/build.log" 2>&1 || die "go build bench/scale: $(tail -n 5 "$tmp/build.log")"
go build -o "$tmp/freeports" ./bench/freeports >>"$tmp/build.log" 2>&1 || die "go build bench/freeports"

# start_node MODE: Caddy with the sluice app on fresh ports, under a
# supervisor loop that starts it again when it exits (at most 3 starts,
# none once $tmp/stop exists); waits until its admin endpoint answers.
start_node() {
	local mode=$1 end
	free_ports CONTROL_PORT HTTP_PORT ADMIN_PORT
	mkdir -p "$tmp/storage" "$tmp/xdg-data" "$tmp/xdg-config"
	cat >"$tmp/Caddyfile" <<EOF
{
	admin 127.0.0.1:$ADMIN_PORT
	persist_config off
	auto_https off
	storage file_system $tmp/storage
	default_bind 127.0.0.1
	log default {
		output stderr
		level WARN
	}
	sluice {
		listen 127.0.0.1:$CONTROL_PORT
		token $TOKEN
		max_sessions $((N_OF[$mode] + 256))
		max_pending_streams $((N_OF[$mode] + 256))
		max_pending_streams_per_address $((N_OF[$mode] + 256))
	}
}

http://:$HTTP_PORT {
	bind 127.0.0.1
	sluice
}
EOF
	rm -f "$tmp/stop" "$tmp/caddy.pid"
	(
		for start in 1 2 3; do
			[ ! -e "$tmp/stop" ] || break
			echo "---- start $start $(date -u +%T)" >&2
			env XDG_DATA_HOME="$tmp/xdg-data" XDG_CONFIG_HOME="$tmp/xdg-config" \
				"$CADDY" run --config "$tmp/Caddyfile" --adapter caddyfile --pidfile "$tmp/caddy.pid" || true
		done
	) >>"$tmp/caddy.$mode.log" 2>&1 &
	SUP_PID=$!
	end=$((SECONDS + READY_TIMEOUT))
	until [ -s "$tmp/caddy.pid" ] && curl -fs -o /dev/null --max-time 2 "http://127.0.0.1:$ADMIN_PORT/metrics"; do
		kill -0 "$SUP_PID" 2>/dev/null || die "caddy exited: $(tail -n 5 "$tmp/caddy.$mode.log")"
		[ "$SECONDS" -lt "$end" ] || die "caddy's admin endpoint not up after ${READY_TIMEOUT}s"
		sleep 0.1
	done
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
failed=()
for mode in $LANES; do
	log "data lane $mode: starting caddy"
	start_node "$mode"
	lane=true
	[ "$mode" = on ] || lane=false
	log "data lane $mode: bench/scale -n ${N_OF[$mode]} (bounded at $DEADLINE_MIN min)"
	status=0
	timeout --signal=TERM --kill-after=60 $((DEADLINE_MIN * 60 + 120)) \
		"$tmp/scale" -control "grpc://127.0.0.1:$CONTROL_PORT" -token "$TOKEN" \
		-http "http://127.0.0.1:$HTTP_PORT" -admin "http://127.0.0.1:$ADMIN_PORT" -pidfile "$tmp/caddy.pid" \
		-n "${N_OF[$mode]}" -lane="$lane" -launch-rate "$LAUNCH_RATE" -connect-window "$CONNECT_WINDOW" -connect-timeout "$CONNECT_TIMEOUT" -adv-reps "$ADV_REPS" \
		-storm="$([ "$STORM" = 1 ] && echo true || echo false)" -storm-signal "$STORM_SIGNAL" -storm-timeout "$STORM_TIMEOUT" \
		-deadline "${DEADLINE_MIN}m" \
		-heap-out "$tmp/heap.$mode.pb.gz" -heap-base-out "$tmp/heap-base.$mode.pb.gz" \
		-goroutines-out "$tmp/goroutines.$mode.txt" -results "$tmp/results.$mode" \
		>"$tmp/report.$mode" 2> >(tee "$tmp/scale.$mode.log" >&2) || status=$?
	cat "$tmp/report.$mode"
	stop_node
	if [ "$status" != 0 ] || ! grep -q '^connect_all_s ' "$tmp/results.$mode" 2>/dev/null; then
		# The run's report says what went wrong (e.g. agents that never
		# connected, with the agents' log); the other run still goes.
		failed+=("data lane $mode: bench/scale exited with status $status (its report above says why)")
		log "WARNING: ${failed[-1]}"
		touch "$tmp/results.$mode"
	fi
done

# ---------------------------------------------------------------- report

declare -A R
for mode in $LANES; do
	while read -r k v; do R[$k,$mode]=$v; done <"$tmp/results.$mode"
done
row() { # row KEY LABEL
	local mode cells=()
	for mode in $LANES; do cells+=("${R[$1,$mode]:--}"); done
	printf '%-58s' "$2"
	printf ' | %10s' "${cells[@]}"
	printf '\n'
}
echo
echo "sluice scale bench: SCALE_N=$N agents in one process (the agents row: each run's), 2 hosts each; $(nproc) CPUs, $(go env GOVERSION), caddy $("$CADDY" version | awk '{ print $1 }'), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "the node, the agents and the probes share the machine's CPUs; load average before: $LOAD_BEFORE, after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '%-58s' "data lane"
for mode in $LANES; do printf ' | %10s' "$mode"; done
printf '\n'
row n "agents (N)"
row connect_all_s "time until all N connected, s"
row connect_p50_s "  per agent p50, s"
row connect_p90_s "  per agent p90, s"
row connect_failed_attempts "  failed attempts on the way"
row node_rss_per_session_kib "node RSS per idle session, KiB (target <= 64)"
row node_heap_per_session_kib "node Go heap per idle session, KiB"
row node_stack_per_session_kib "node goroutine stacks per idle session, KiB"
row node_goroutines_per_session "node goroutines per idle session"
row node_rss_idle_mib "node RSS with N idle sessions, MiB"
row node_cpu_connect_ms_per_session "node CPU to connect them, ms per session"
row agent_rss_per_agent_kib "agents' process RSS per agent, KiB"
row agent_goroutines_per_agent "agents' process goroutines per agent"
row probe_idle_ms "probe through the node with N idle, median ms"
row adv1_empty_ms "Advertise of 1 route, empty node: Run to ack, ms"
row adv_many_extra_empty_ms "  1,000 routes cost more, empty node, ms"
row adv1_atN_ms "Advertise of 1 route at N sessions: Run to ack, ms"
row adv_many_extra_atN_ms "  1,000 routes cost more at N sessions, ms"
if [ "$STORM" = 1 ]; then
	row storm_ctrl_up_s "storm (SIG$STORM_SIGNAL): new node accepting after, s"
	row storm_p50_s "  agents back: p50 from accepting, s"
	row storm_p90_s "  agents back: p90, s"
	row storm_all_s "  agents back: all (or the last of those back), s"
	row storm_missing "  agents not back by SCALE_STORM_TIMEOUT"
	row storm_failed_attempts "  failed attempts"
	row storm_node_hwm_mib "  new node's peak RSS, MiB"
	row storm_node_max_goroutines "  new node's most goroutines (sampled 1/s)"
	row storm_node_cpu_s "  new node's CPU until all back, s"
	row storm_probe_max_ms "  probe every 100 ms once up: max latency, ms"
	row storm_probe_p99_ms "  probe: p99 latency, ms"
	row storm_probe_unanswered "  probes without an answer (5 s timeout)"
	row storm_after_rss_per_session_kib "  node RSS per session after the storm, KiB"
fi

# The node's heap with N idle sessions less its heap before them, by
# allocation site (pprof -diff_base), per session.
for mode in $LANES; do
	[ -s "$tmp/heap.$mode.pb.gz" ] || continue
	echo
	echo "node heap in use with N idle sessions less before (data lane $mode), by allocation site: bytes, KiB per session"
	go tool pprof -top -sample_index=inuse_space -unit=B -nodecount=18 -diff_base "$tmp/heap-base.$mode.pb.gz" \
		"$CADDY" "$tmp/heap.$mode.pb.gz" 2>/dev/null |
		awk -v n="${N_OF[$mode]}" '/^ *-?[0-9]+B? +-?[0-9.]+%/ {
			b = $1; sub(/B$/, "", b); name = $6; for (i = 7; i <= NF; i++) name = name " " $i
			printf "  %12d B %8.2f KiB  %s\n", b, b / 1024 / n, name }'
	echo "  (flat; cumulative by caller: go tool pprof -top -cum -diff_base heap-base.$mode.pb.gz heap.$mode.pb.gz, kept with SCALE_OUT)"
done

if [ "${#failed[@]}" -gt 0 ]; then
	echo
	echo "failed runs:"
	printf '  %s\n' "${failed[@]}"
fi

if [ -n "${SCALE_OUT:-}" ]; then
	mkdir -p "$SCALE_OUT"
	cp "$tmp"/report.* "$tmp"/results.* "$tmp"/heap*.pb.gz "$tmp"/goroutines.*.txt "$tmp"/caddy.*.log "$SCALE_OUT"/ 2>/dev/null || true
	log "reports, results, profiles and caddy logs copied to $SCALE_OUT"
fi
[ "${#failed[@]}" = 0 ]
