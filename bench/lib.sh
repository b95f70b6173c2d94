# bench/lib.sh: what bench/http.sh and bench/tcp.sh share. Sourced by both
# from the repository root (after `set -euo pipefail` and the cd there, with
# ROOT set); it defines the common settings and functions and runs nothing
# else. Each script defines, before the helpers below use them:
#
#   paths              the columns of its loads (direct first), e.g. (direct caddy sluice)
#   URL[path]          http://host:port of each path
#   VIA[path]          the processes a path goes through besides the upstream ("caddy agent")
#   cpu_other KEY PATH R[KEY_other,PATH] (and any extra CPU rows), called by cpu_stop
#   FMT, SEP, COLUMNS  the table: printf format, separator line, and one entry
#                      per column after the label: a path, or A/B for R[..,A] / R[..,B]
#   BASE               the path targets compare against (caddy, l4)
#   CPU_IRQ            non-empty: the table has irq+softirq rows (cpu_other fills them)

if [ "${BENCH_QUICK:-0}" = 1 ]; then
	MODE=quick
	SINGLE_SIZE=$((64 << 20))
	WRK_DURATION=3s
	IDLE_N=100
	ROUNDS=${BENCH_ROUNDS:-1}
else
	MODE=full
	SINGLE_SIZE=$((1 << 30))
	WRK_DURATION=10s
	IDLE_N=500
	ROUNDS=${BENCH_ROUNDS:-3}
fi
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "bench: BENCH_ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 1; }
TTFB_RUNS=20
# BENCH_GOMAXPROCS=N runs Caddy and the agent (not the upstream, the relay
# or the clients) with GOMAXPROCS=N, every path alike.
PROCS_ENV=${BENCH_GOMAXPROCS:+GOMAXPROCS=$BENCH_GOMAXPROCS}
# BENCH_PIN=1 pins the processes as if on two hosts (taskset): the first
# half of the CPUs is the public host (Caddy and the clients: curl, wrk,
# idleconns), the second half the private one (the upstream, the agent, the
# relay). On one shared machine the agent's CPU competes with Caddy's; in a
# deployment it runs next to the upstream, not next to Caddy.
PIN_PUBLIC=()
PIN_PRIVATE=()
if [ "${BENCH_PIN:-0}" = 1 ]; then
	command -v taskset >/dev/null 2>&1 || { echo "bench: BENCH_PIN=1 needs taskset (util-linux)" >&2; exit 1; }
	_ncpu=$(nproc)
	[ "$_ncpu" -ge 2 ] || { echo "bench: BENCH_PIN=1 needs at least 2 CPUs" >&2; exit 1; }
	PIN_PUBLIC=(taskset -c "0-$((_ncpu / 2 - 1))")
	PIN_PRIVATE=(taskset -c "$((_ncpu / 2))-$((_ncpu - 1))")
fi
# SHARING describes, for the report, how the processes share the CPUs.
if [ "${#PIN_PUBLIC[@]}" = 0 ]; then
	SHARING="every process on this machine shares its CPUs (clients included)"
else
	SHARING="the processes are pinned as two hosts (see below)"
fi
HOST=app.test
TOKEN=bench
READY_TIMEOUT=30 # seconds, per component

log() { echo "bench: $*" >&2; }

# ---------------------------------------------------------------- setup

# bench_setup NAME: checks the tools, makes the temp dir ($tmp,
# ${TMPDIR:-/tmp}/NAME.XXXXXX) and installs the cleanup traps.
bench_setup() {
	local tool
	for tool in curl wrk go awk; do
		command -v "$tool" >/dev/null 2>&1 || { log "$tool is required"; exit 1; }
	done
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
	pids=()
	trap cleanup EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
}

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

# find_caddy: CADDY as given, or ./caddy, rebuilt with ./xcaddy.sh when missing
# or older than a non-test *.go file, go.mod or go.sum.
find_caddy() {
	local stale
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
}

# build_binaries: sluice-agent, the sample upstream and the bench helpers, into $tmp.
build_binaries() {
	log "building sluice-agent, the sample upstream and the bench helpers"
	go build -o "$tmp/sluice-agent" ./agent/cmd/sluice-agent >"$tmp/build.log" 2>&1 || die "go build sluice-agent"
	go build -o "$tmp/upstream" ./demo/upstream >>"$tmp/build.log" 2>&1 || die "go build demo/upstream"
	go build -o "$tmp/idleconns" ./bench/idleconns >>"$tmp/build.log" 2>&1 || die "go build bench/idleconns"
	go build -o "$tmp/freeports" ./bench/freeports >>"$tmp/build.log" 2>&1 || die "go build bench/freeports"
	go build -o "$tmp/tcprelay" ./bench/tcprelay >>"$tmp/build.log" 2>&1 || die "go build bench/tcprelay"
}

# ---------------------------------------------------------------- processes

# free_ports VAR...: sets each VAR to a distinct free loopback port.
free_ports() {
	local ports
	ports=$("$tmp/freeports" -n $#) || die "no free ports"
	read -r "$@" <<<"$(echo $ports)"
	[ -n "${!#}" ] || die "freeports returned too few ports: $ports"
}

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

# start_upstream ADDR: the sample upstream on ADDR; sets UP_PID.
start_upstream() {
	"${PIN_PRIVATE[@]}" "$tmp/upstream" -listen "$1" -name bench >"$tmp/upstream.log" 2>&1 &
	UP_PID=$!
	pids+=("$UP_PID")
}

# start_relay LISTEN TO: bench/tcprelay from LISTEN to TO (the "one more
# hop" reference path); sets RELAY_PID.
start_relay() {
	"${PIN_PRIVATE[@]}" "$tmp/tcprelay" -listen "$1" -to "$2" >"$tmp/relay.log" 2>&1 &
	RELAY_PID=$!
	pids+=("$RELAY_PID")
}

# caddy_globals: the global options every bench Caddyfile starts with: no
# admin API, no autosave, no certificates, storage in $tmp, errors only.
caddy_globals() {
	printf '\tadmin off\n\tpersist_config off\n\tauto_https off\n\tstorage file_system %s/storage\n' "$tmp"
	printf '\tlog default {\n\t\toutput stderr\n\t\tlevel ERROR\n\t}\n'
}

# start_caddy: runs $CADDY with $tmp/Caddyfile (storage in $tmp/storage); sets CADDY_PID.
start_caddy() {
	mkdir -p "$tmp/storage" "$tmp/xdg-data" "$tmp/xdg-config"
	"${PIN_PUBLIC[@]}" env XDG_DATA_HOME="$tmp/xdg-data" XDG_CONFIG_HOME="$tmp/xdg-config" $PROCS_ENV \
		"$CADDY" run --config "$tmp/Caddyfile" --adapter caddyfile >"$tmp/caddy.log" 2>&1 &
	CADDY_PID=$!
	pids+=("$CADDY_PID")
}

# start_agent ARG...: sluice-agent on the control port with these extra
# arguments (its -upstream flags); sets AGENT_PID.
start_agent() {
	"${PIN_PRIVATE[@]}" env $PROCS_ENV "$tmp/sluice-agent" -server "grpc://127.0.0.1:$CONTROL_PORT" -token "$TOKEN" -id bench -log-level error \
		"$@" >"$tmp/agent.log" 2>&1 &
	AGENT_PID=$!
	pids+=("$AGENT_PID")
}

# ---------------------------------------------------------------- measuring

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

# CPU accounting: utime+stime (clock ticks) of Caddy, the agent, the
# upstream and the relay (0 when the script runs none).
CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() {
	if [ -z "$1" ]; then echo 0; else awk '{ print $14 + $15 }' "/proc/$1/stat"; fi
}
# machine_ticks: "busy total irq" clock ticks of all CPUs (/proc/stat); irq =
# hardirq + softirq time, which the kernel charges to no process (with this
# much loopback traffic, mostly the network stack's softirqs).
machine_ticks() { awk '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t, $7 + $8; exit }' /proc/stat; }
# children_ticks: CPU of this script's finished children (curl, wrk): cutime+cstime.
children_ticks() { awk '{ print $16 + $17 }' "/proc/$$/stat"; }
cpu_start() {
	cpu0=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)" "$(cpu_ticks "${RELAY_PID:-}")")
	read -r busy0 total0 irq0 < <(machine_ticks)
}
# cpu_stop KEY PATH UNITS SCALE: R[KEY_<process>,PATH] = CPU seconds / UNITS * SCALE
# for the processes PATH goes through (VIA[PATH] and the upstream), R[KEY_busy,PATH]
# and what the script's cpu_other adds (it sees now, busy, total and irq).
cpu_stop() {
	local key=$1 p=$2 units=$3 scale=$4 now busy total irq proc
	now=("$(cpu_ticks "$CADDY_PID")" "$(cpu_ticks "$AGENT_PID")" "$(cpu_ticks "$UP_PID")" "$(children_ticks)" "$(cpu_ticks "${RELAY_PID:-}")")
	read -r busy total irq < <(machine_ticks)
	R[${key}_busy,$p]=$(calc %.0f "100 * ($busy - $busy0) / ($total - $total0 + 1)")
	cpu_other "$key" "$p"
	cpu_set() { R[${key}_$1,$p]=$(calc %.2f "(${now[$2]} - ${cpu0[$2]}) / $CLK_TCK / ($units) * $scale"); }
	for proc in ${VIA[$p]:-}; do
		case $proc in
		caddy) cpu_set caddy 0 ;;
		agent) cpu_set agent 1 ;;
		relay) cpu_set relay 4 ;;
		esac
	done
	cpu_set upstream 2
}

idle_fds=()
idle_pids=()
# idle_open NAME ADDR: opens IDLE_N idle keep-alive connections (one GET
# each), returns once they are all up.
idle_open() {
	local name=$1 addr=$2 fifo=$tmp/idle.$1.in fd pid end=$((SECONDS + 60))
	mkfifo "$fifo"
	"${PIN_PUBLIC[@]}" "$tmp/idleconns" -addr "$addr" -host "$HOST" -n "$IDLE_N" -hold 60s \
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

# idle_close: closes every idle_open batch and waits for the helpers.
idle_close() {
	local fd p
	for fd in "${idle_fds[@]}"; do exec {fd}>&-; done
	for p in "${idle_pids[@]}"; do wait "$p" || log "idleconns $p exited with $?"; done
}

# idle_batches NAME ADDR [NAME ADDR]...: idle connection RSS. Run first, while
# Caddy and the agent are fresh: memory freed by a load is kept by the Go
# runtime and reused, which would hide the cost of new connections. Opens
# IDLE_N connections to each ADDR in turn; each batch stays open while the
# next is opened, so each lands on fresh memory; then closes them all.
# caddy_rss[i], agent_rss[i]: RSS in KiB after i batches (0: before any).
idle_batches() {
	caddy_rss=("$(rss_kib "$CADDY_PID")")
	agent_rss=("$(rss_kib "$AGENT_PID")")
	while [ "$#" -ge 2 ]; do
		idle_open "$1" "$2"
		caddy_rss+=("$(rss_kib "$CADDY_PID")")
		agent_rss+=("$(rss_kib "$AGENT_PID")")
		shift 2
	done
	idle_close
}

# per_conn AFTER BEFORE: (AFTER - BEFORE) KiB / IDLE_N, one decimal.
per_conn() { calc %.1f "($1 - $2) / $IDLE_N"; }

# ---------------------------------------------------------------- loads

warnings=()
warn() {
	warnings+=("$*")
	log "WARNING: $*"
}

# each_path LOAD: runs LOAD PATH for every path, ROUNDS times, the paths in
# turn and in reverse order every other round (so drift of the machine
# spreads over all of them), and keeps in R the median of each result over
# the rounds. One pass over the paths takes seconds, and a shared 2-core
# machine moves by ±15% between passes: a ratio of two paths measured in
# different passes is only as good as that.
each_path() {
	local load=$1 r i p k
	local -a order
	local -A seen=()
	for ((r = 1; r <= ROUNDS; r++)); do
		order=()
		for ((i = 0; i < ${#paths[@]}; i++)); do
			if ((r % 2)); then order+=("${paths[i]}"); else order=("${paths[i]}" "${order[@]}"); fi
		done
		[ "$ROUNDS" = 1 ] || log "   round $r of $ROUNDS: ${order[*]}"
		for p in "${order[@]}"; do "$load" "$p"; done
		for k in "${!R[@]}"; do seen[$k]+="${R[$k]} "; done
	done
	for k in "${!seen[@]}"; do R[$k]=$(median_of ${seen[$k]}); done
}

# median_of WORD...: the median of the words when all are numbers, else the
# last one (a "-" of a failed load stays visible). Equal words come back as
# they are.
median_of() {
	local w same=1
	for w in "$@"; do
		[[ "$w" =~ ^-?[0-9.]+$ ]] || { echo "${@: -1}"; return; }
		[ "$w" = "$1" ] || same=0
	done
	if [ "$same" = 1 ]; then echo "$1"; return; fi
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%.10g\n", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# one big download
single() {
	local p=$1 out code size t
	cpu_start
	out=$("${PIN_PUBLIC[@]}" curl -s -o /dev/null --max-time 300 -H "Host: $HOST" \
		-w '%{http_code} %{size_download} %{time_total}' "${URL[$p]}/download?size=$SINGLE_SIZE" || true)
	read -r code size t <<<"$out"
	if [ "$code" != 200 ] || [ "$size" != "$SINGLE_SIZE" ]; then
		warn "$p: single download: status $code, $size of $SINGLE_SIZE bytes"
	fi
	R[single,$p]=$(calc %.1f "${size:-0} / ${t:-1} / 1e6")
	cpu_stop cpu_single "$p" "${size:-0} + 1" 1e9
}

# small requests with wrk (64 keep-alive connections; over a TCP relay each
# is one relayed connection for the whole run)
small() {
	local p=$1 f=$tmp/wrk.$1 v n
	cpu_start
	"${PIN_PUBLIC[@]}" wrk -t2 -c64 -d"$WRK_DURATION" --latency -H "Host: $HOST" "${URL[$p]}/" >"$f" 2>&1 ||
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

# time to first byte on a fresh connection (one curl process per run):
# through a TCP relay every client connection is a new upstream connection
# (through sluice: a new virtual connection and an agent dial).
ttfb() {
	local p=$1 i out code t
	: >"$tmp/ttfb.$p"
	for i in $(seq 1 "$TTFB_RUNS"); do
		out=$("${PIN_PUBLIC[@]}" curl -s -o /dev/null --max-time 10 -H "Host: $HOST" \
			-w '%{http_code} %{time_starttransfer}' "${URL[$p]}/" || true)
		read -r code t <<<"$out"
		[ "$code" = 200 ] || warn "$p: ttfb run $i: status $code"
		echo "${t:-0}" >>"$tmp/ttfb.$p"
	done
	R[ttfb,$p]=$(sort -g "$tmp/ttfb.$p" | awk '{ v[NR] = $1 } END {
		m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f", m * 1000 }')
}

# ---------------------------------------------------------------- report

ratio() { # ratio A B -> A/B with 2 decimals, or "-"
	if [[ "${1:-}" =~ ^[0-9.]+$ && "${2:-}" =~ ^[0-9.]+$ ]] && awk "BEGIN { exit !($2 > 0) }"; then
		calc %.2f "$1 / $2"
	else
		echo -n "-"
	fi
}

# report_header KIND LINE: the lines above the table.
report_header() {
	local caddy_version
	caddy_version=$("$CADDY" version | awk '{ print $1 }')
	echo
	echo "sluice $1 bench ($MODE): $(nproc) CPUs, $(go env GOVERSION), caddy $caddy_version, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "$2"
	[ "$ROUNDS" = 1 ] || echo "every load ran $ROUNDS rounds over all paths (the path order reversed every other round); each figure is the median (BENCH_ROUNDS)"
	[ -z "$PROCS_ENV" ] || echo "Caddy and the agent ran with $PROCS_ENV (BENCH_GOMAXPROCS)"
	[ "${#PIN_PUBLIC[@]}" = 0 ] || echo "pinned as two hosts (BENCH_PIN): public CPUs ${PIN_PUBLIC[2]} (Caddy, clients), private CPUs ${PIN_PRIVATE[2]} (upstream, agent, relay)"
	echo "load average before the loads: $LOAD_BEFORE; after: $(cut -d' ' -f1-3 /proc/loadavg)"
	echo
}

row() { # row KEY LABEL [noratio]
	local c cells=()
	for c in "${COLUMNS[@]}"; do
		if [[ $c != */* ]]; then
			cells+=("${R[$1,$c]:--}")
		elif [ -n "${3:-}" ]; then
			cells+=(-)
		else
			cells+=("$(ratio "${R[$1,${c%/*}]:--}" "${R[$1,${c#*/}]:--}")")
		fi
	done
	printf "$FMT" "$2" "${cells[@]}"
}

sep() { printf '%s\n' "$SEP"; }

# rows_requests: the small GET, TTFB and idle RSS rows.
rows_requests() {
	row rps "small GET /, requests/s"
	row p50 "small GET /, p50 ms (lower=better)"
	row p99 "small GET /, p99 ms (lower=better)"
	row ttfb "TTFB fresh conn, median ms (lower)"
	row rss_caddy "Caddy RSS per idle conn, KiB"
	row rss_agent "agent RSS per idle conn, KiB"
}

# rows_cpu KEY LOAD UNIT: the CPU rows of one load (cpu_stop KEY), the
# irq+softirq row too when CPU_IRQ is set.
rows_cpu() {
	row "${1}_caddy" "$2: Caddy CPU $3"
	row "${1}_agent" "$2: agent CPU $3"
	[ -z "${RELAY_PID:-}" ] || row "${1}_relay" "$2: relay CPU $3"
	row "${1}_upstream" "$2: upstream CPU $3"
	row "${1}_busy" "$2: machine CPU busy %" noratio
	[ -z "${CPU_IRQ:-}" ] || row "${1}_irq" "$2: irq+softirq CPU %" noratio
	row "${1}_other" "$2: other processes CPU %" noratio
}

target() { # target LABEL KEY MIN PATH: R[KEY,PATH] / R[KEY,BASE] >= MIN?
	local r
	r=$(ratio "${R[$2,$4]:-}" "${R[$2,$BASE]:-}")
	if [ "$r" = "-" ]; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "-" "MISS (no data)"
	elif awk "BEGIN { exit !($r >= $3) }"; then
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" PASS
	else
		printf '  %-44s >= %-4s  %6s  %s\n' "$1" "$3" "$r" MISS
	fi
}

# reference LABEL KEY: the hop/BASE line for R[KEY,..]: what one more bare
# process on the path costs by itself (no target; context for the ratios).
reference() {
	printf '  %-44s %s\n' "$1" "$(ratio "${R[$2,hop]:-}" "${R[$2,$BASE]:-}")"
}

# report_warnings: the warnings collected by warn, if any.
report_warnings() {
	if [ "${#warnings[@]}" -gt 0 ]; then
		echo
		echo "warnings:"
		printf '  %s\n' "${warnings[@]}"
	fi
}
