#!/usr/bin/env bash
# bench/ab.sh: is build B of the tunnel faster than build A? A paired
# comparison of two revisions, side by side on one machine and one upstream.
#
#   bench/ab.sh REV_A [REV_B]     # REV: a git revision, or . for the working tree (B's default)
#   AB_ROUNDS=10 bench/ab.sh HEAD~1
#   AB_SIZE=$((1<<30)) bench/ab.sh main .
#   AB_LOADS="http tcp" bench/ab.sh HEAD   # only some of the loads
#
# It builds Caddy (./xcaddy.sh) and sluice-agent at both revisions (a git
# worktree per revision, in the temp dir), starts one upstream, and for each
# build one Caddy (a `sluice` HTTP site and a caddy-l4 `sluice` route) with
# its agent, all on 127.0.0.1. Then, for AB_ROUNDS rounds, it puts the same
# loads on A and on B, alternating which goes first (A B, B A, ...) so drift
# of the machine spreads over both:
#
#   http  wrk -t2 -c64 -d5s GET / through the HTTP site      requests/s, Caddy+agent CPU us/req
#   tcp   the same through the caddy-l4 route                 requests/s, Caddy+agent CPU us/req
#   dl    one AB_SIZE download (512 MiB) through the HTTP site MB/s, Caddy+agent CPU s/GB
#   par   8 concurrent downloads of AB_SIZE/8 each, the same    MB/s (aggregate), CPU s/GB
#
# and prints each round, then per load the median of A and of B, B/A, and in
# how many rounds B beat A. On a shared 2-core machine one run of bench/http.sh
# moves by ±15%; a paired median over rounds separates a change of a few
# percent from that noise, which is what this script is for. The exit
# status is non-zero only when the setup fails. Needs go, curl, wrk, git.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. bench/lib.sh

REV_A=${1:?usage: bench/ab.sh REV_A [REV_B]}
REV_B=${2:-.}
ROUNDS=${AB_ROUNDS:-6}
SIZE=${AB_SIZE:-$((512 << 20))}
WRK_AB=${AB_WRK_DURATION:-5s}

bench_setup sluice-bench-ab
command -v git >/dev/null 2>&1 || die "git is required"
build_binaries # the upstream and freeports, from the working tree: common to A and B

# build SIDE REV: Caddy and the agent of REV into $tmp/SIDE-caddy, $tmp/SIDE-agent.
build() {
	local side=$1 rev=$2 src
	if [ "$rev" = . ]; then
		src=$ROOT
	else
		src=$tmp/src-$side
		git worktree add --detach -q "$src" "$rev" 2>"$tmp/worktree-$side.log" || die "git worktree add $rev"
		worktrees+=("$src")
	fi
	log "building $side = $rev (xcaddy and sluice-agent)"
	(cd "$src" && OUTPUT=$tmp/$side-caddy ./xcaddy.sh) >"$tmp/xcaddy-$side.log" 2>&1 || die "xcaddy at $rev"
	(cd "$src" && go build -o "$tmp/$side-agent" ./agent/cmd/sluice-agent) >"$tmp/agent-build-$side.log" 2>&1 ||
		die "go build sluice-agent at $rev"
}
worktrees=()
remove_worktrees() {
	local w
	for w in "${worktrees[@]}"; do git worktree remove --force "$w" 2>/dev/null || true; done
}
ab_cleanup() {
	local status=$?
	remove_worktrees
	(exit "$status") # cleanup exits with the status it finds
	cleanup
}
trap ab_cleanup EXIT
build A "$REV_A"
build B "$REV_B"

free_ports UP_PORT CTL_A HTTP_A TCP_A CTL_B HTTP_B TCP_B
start_upstream "127.0.0.1:$UP_PORT"
wait_ok upstream "http://127.0.0.1:$UP_PORT/" "$UP_PID"

declare -A CADDY_PID AGENT_PID HTTP_URL TCP_URL
# start SIDE CONTROL HTTP TCP: SIDE's Caddy and agent.
start() {
	local side=$1 ctl=$2 http=$3 tcp=$4
	mkdir -p "$tmp/$side-data"
	cat >"$tmp/$side.Caddyfile" <<EOF
{
	admin off
	persist_config off
	auto_https off
	storage file_system $tmp/$side-data/storage
	log default {
		output stderr
		level ERROR
	}
	sluice {
		listen 127.0.0.1:$ctl
		token $TOKEN
	}
	layer4 {
		127.0.0.1:$tcp {
			route {
				sluice bench
			}
		}
	}
}
http://:$http {
	bind 127.0.0.1
	sluice
}
EOF
	env XDG_DATA_HOME="$tmp/$side-data" XDG_CONFIG_HOME="$tmp/$side-data" \
		"$tmp/$side-caddy" run --config "$tmp/$side.Caddyfile" --adapter caddyfile >"$tmp/$side-caddy.log" 2>&1 &
	CADDY_PID[$side]=$!
	pids+=("$!")
	"$tmp/$side-agent" -server "grpc://127.0.0.1:$ctl" -token "$TOKEN" -id bench -log-level error \
		-upstream "host=$HOST,target=http://127.0.0.1:$UP_PORT" \
		-upstream "name=bench,target=tcp://127.0.0.1:$UP_PORT" >"$tmp/$side-agent.log" 2>&1 &
	AGENT_PID[$side]=$!
	pids+=("$!")
	HTTP_URL[$side]=http://127.0.0.1:$http
	TCP_URL[$side]=http://127.0.0.1:$tcp
	wait_ok "$side over HTTP" "${HTTP_URL[$side]}/" "${AGENT_PID[$side]}"
	wait_ok "$side over TCP" "${TCP_URL[$side]}/" "${AGENT_PID[$side]}"
}
start A "$CTL_A" "$HTTP_A" "$TCP_A"
start B "$CTL_B" "$HTTP_B" "$TCP_B"

# ticks SIDE: utime+stime of SIDE's Caddy and agent together.
ticks() { echo $(($(cpu_ticks "${CADDY_PID[$1]}") + $(cpu_ticks "${AGENT_PID[$1]}"))); }

# measure LOAD SIDE: prints "value cpu" (value: req/s or MB/s; cpu: us/req or s/GB).
measure() {
	local load=$1 side=$2 t0 t1 out reqs v
	t0=$(ticks "$side")
	case $load in
	http | tcp)
		local url=${HTTP_URL[$side]}
		[ "$load" = tcp ] && url=${TCP_URL[$side]}
		out=$(wrk -t2 -c64 -d"$WRK_AB" -H "Host: $HOST" "$url/") || die "wrk $load $side"
		v=$(awk '/^Requests\/sec:/ { print $2 }' <<<"$out")
		reqs=$(awk '/requests in/ { print $1 }' <<<"$out")
		t1=$(ticks "$side")
		echo "$v $(calc %.1f "($t1 - $t0) / $CLK_TCK * 1e6 / $reqs")"
		;;
	dl)
		v=$(curl -sS -o /dev/null --max-time 120 -H "Host: $HOST" -w '%{speed_download}' \
			"${HTTP_URL[$side]}/download?size=$SIZE") || die "download $side"
		t1=$(ticks "$side")
		echo "$(calc %.0f "$v / 1e6") $(calc %.2f "($t1 - $t0) / $CLK_TCK / ($SIZE / 1e9)")"
		;;
	par)
		local start=$EPOCHREALTIME i cps=()
		for i in 1 2 3 4 5 6 7 8; do
			curl -sS -o /dev/null --max-time 120 -H "Host: $HOST" "${HTTP_URL[$side]}/download?size=$((SIZE / 8))" &
			cps+=($!)
		done
		for i in "${cps[@]}"; do wait "$i" || die "parallel download $side"; done
		t1=$(ticks "$side")
		echo "$(calc %.0f "$SIZE / 1e6 / ($EPOCHREALTIME - $start)") $(calc %.2f "($t1 - $t0) / $CLK_TCK / ($SIZE / 1e9)")"
		;;
	esac
}

read -ra loads <<<"${AB_LOADS:-http tcp dl par}"
declare -A VAL CPU # VAL[load,side] / CPU[load,side]: space-separated per round
log "A = $REV_A, B = $REV_B: $ROUNDS rounds of ${loads[*]} (wrk $WRK_AB, download $((SIZE >> 20)) MiB)"
printf '%-5s %-5s %12s %10s %12s %10s\n' round load "A value" "A cpu" "B value" "B cpu"
for r in $(seq 1 "$ROUNDS"); do
	order=(A B)
	[ $((r % 2)) = 0 ] && order=(B A)
	for load in "${loads[@]}"; do
		declare -A got=()
		for side in "${order[@]}"; do
			got[$side]=$(measure "$load" "$side")
			read -r v c <<<"${got[$side]}"
			VAL[$load,$side]+="$v "
			CPU[$load,$side]+="$c "
		done
		printf '%-5s %-5s %12s %10s %12s %10s\n' "$r" "$load" ${got[A]} ${got[B]}
	done
done

# wins A_WORDS B_WORDS BIGGER: rounds where B beat A (BIGGER=1: larger is better).
wins() {
	local -a a=($1) b=($2)
	local i n=0
	for i in "${!a[@]}"; do
		if [ "$3" = 1 ]; then
			awk -v x="${b[$i]}" -v y="${a[$i]}" 'BEGIN { exit !(x > y) }' && n=$((n + 1))
		else
			awk -v x="${b[$i]}" -v y="${a[$i]}" 'BEGIN { exit !(x < y) }' && n=$((n + 1))
		fi
	done
	echo "$n/${#a[@]}"
}

echo
echo "A = $REV_A, B = $REV_B; medians over $ROUNDS rounds (Caddy and agent CPU together)"
printf '%-30s %10s %10s %7s %8s\n' metric A B B/A "B better"
for load in "${loads[@]}"; do
	case $load in
	http) name="HTTP small GET, req/s" cname="HTTP small GET, CPU us/req" ;;
	tcp) name="TCP small GET, req/s" cname="TCP small GET, CPU us/req" ;;
	dl) name="download, MB/s" cname="download, CPU s/GB" ;;
	par) name="8 parallel downloads, MB/s" cname="8 parallel, CPU s/GB" ;;
	esac
	a=$(median_of ${VAL[$load,A]}) b=$(median_of ${VAL[$load,B]})
	printf '%-30s %10s %10s %7s %8s\n' "$name" "$a" "$b" "$(calc %.3f "$b / $a")" "$(wins "${VAL[$load,A]}" "${VAL[$load,B]}" 1)"
	a=$(median_of ${CPU[$load,A]}) b=$(median_of ${CPU[$load,B]})
	printf '%-30s %10s %10s %7s %8s\n' "$cname" "$a" "$b" "$(calc %.3f "$b / $a")" "$(wins "${CPU[$load,A]}" "${CPU[$load,B]}" 0)"
done
