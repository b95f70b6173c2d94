//go:build linux

// Command scale runs N sluice agents in this one process (the agent
// library) against one running sluice node (Caddy with the sluice app) and
// measures what the node pays for them: the time until all N are
// connected, the node's RSS, Go heap and goroutines per idle agent session,
// the cost of one Advertise of many routes, and a reconnection storm (the
// node restarted under all N agents).
//
// It starts no node itself: bench/scale.sh starts Caddy (under a bounded
// supervisor loop that starts it again when it exits, as a service manager
// would, with `caddy run --pidfile`) and passes its addresses:
//
//	scale -control grpc://127.0.0.1:P -token T -http http://127.0.0.1:H \
//	      -admin http://127.0.0.1:A -pidfile caddy.pid -n 10000 [-lane=false]
//
// The node's figures come from its process (/proc/<pid>/status: VmRSS,
// VmHWM) and its admin endpoint (/metrics: go_goroutines,
// go_memstats_heap_inuse_bytes, sluice_tunnel_sessions; /debug/pprof: a GC
// before each reading, the heap and goroutine profiles); the agents' own
// memory is this process's and is reported apart. The human report goes to
// stdout, progress to stderr, the figures as "key value" lines to -results.
// Every wait is bounded (-deadline for the whole run) and every agent is
// stopped before it exits.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/agent"
)

type options struct {
	control, token, httpURL, admin, pidfile string
	n                                       int
	lane                                    bool
	launchRate                              float64
	connectWindow                           int
	connectTimeout, settle, deadline        time.Duration
	advRoutes, advReps                      int
	storm                                   bool
	stormSignal                             string
	stormTimeout                            time.Duration
	heapOut, heapBaseOut, goroutinesOut     string
	resultsOut                              string
	label                                   string
}

func main() {
	var o options
	flag.StringVar(&o.control, "control", "", "the node's control address, grpc://127.0.0.1:port (required)")
	flag.StringVar(&o.token, "token", "", "the node's token (required)")
	flag.StringVar(&o.httpURL, "http", "", "the node's HTTP site with the sluice handler, http://127.0.0.1:port (required)")
	flag.StringVar(&o.admin, "admin", "", "Caddy's admin endpoint, http://127.0.0.1:port (required)")
	flag.StringVar(&o.pidfile, "pidfile", "", "the file `caddy run --pidfile` writes (required)")
	flag.IntVar(&o.n, "n", 10000, "agents, each advertising two hosts")
	flag.BoolVar(&o.lane, "lane", true, "let the agents take the data lane (false: disable_data_lane)")
	flag.Float64Var(&o.launchRate, "launch-rate", 0, "agents started per second; 0 starts them all at once (without -connect-window)")
	flag.IntVar(&o.connectWindow, "connect-window", 0, "at most this many agents connecting at once, the next started when one connected; 0: none (see -launch-rate)")
	flag.DurationVar(&o.connectTimeout, "connect-timeout", 10*time.Minute, "how long all N may take to connect")
	flag.DurationVar(&o.settle, "settle", 5*time.Second, "idle time before the node is measured with all N connected")
	flag.DurationVar(&o.deadline, "deadline", 40*time.Minute, "bound on the whole run")
	flag.IntVar(&o.advRoutes, "adv-routes", 1000, "routes of the large Advertise (at most 1024)")
	flag.IntVar(&o.advReps, "adv-reps", 5, "Advertise measurements of each size, at 0 and at N sessions")
	flag.BoolVar(&o.storm, "storm", true, "restart the node under all N agents and measure the reconnection storm")
	flag.StringVar(&o.stormSignal, "storm-signal", "TERM", "how the node is stopped: TERM (graceful: Drain to every agent) or KILL (a crash)")
	flag.DurationVar(&o.stormTimeout, "storm-timeout", 10*time.Minute, "how long all N may take to come back after the restart")
	flag.StringVar(&o.heapOut, "heap-out", "", "write the node's heap profile with N idle sessions here")
	flag.StringVar(&o.heapBaseOut, "heap-base-out", "", "write the node's heap profile before the agents here (for pprof -diff_base)")
	flag.StringVar(&o.goroutinesOut, "goroutines-out", "", "write the node's goroutine profile (debug=1) with N idle sessions here")
	flag.StringVar(&o.resultsOut, "results", "", "write the figures as \"key value\" lines here")
	flag.StringVar(&o.label, "label", "", "name of the run in the report")
	flag.Parse()
	if err := o.check(); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		flag.Usage()
		os.Exit(2)
	}
	if err := run(o); err != nil {
		logf("FAILED: %v", err)
		os.Exit(1)
	}
}

func (o *options) check() error {
	var missing []string
	for name, v := range map[string]string{"control": o.control, "token": o.token, "http": o.httpURL, "admin": o.admin, "pidfile": o.pidfile} {
		if v == "" {
			missing = append(missing, "-"+name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing %s", strings.Join(missing, ", "))
	}
	if o.n < 1 || o.advRoutes < 1 || o.advRoutes > 1024 || o.advReps < 0 {
		return errors.New("need -n >= 1, 1 <= -adv-routes <= 1024, -adv-reps >= 0")
	}
	switch o.stormSignal {
	case "TERM", "KILL":
	default:
		return fmt.Errorf("-storm-signal %q: TERM or KILL", o.stormSignal)
	}
	return nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "scale: "+format+"\n", args...)
}

func report(format string, args ...any) { fmt.Printf(format+"\n", args...) }

// hostport returns the host:port of a URL.
func hostport(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("%q is not a URL with a host: %v", raw, err)
	}
	return u.Host, nil
}

// fdNeed is the file descriptors this process needs for n agents: the
// gRPC connection of each and, with lane, its data lane, and some to spare.
// The node needs as many.
func fdNeed(n int, lane bool) uint64 {
	if lane {
		return uint64(2*n + 1024)
	}
	return uint64(n + 1024)
}

func run(o options) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, o.deadline)
	defer cancel()

	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("reading the fd limit: %w", err)
	}
	if need := fdNeed(o.n, o.lane); lim.Cur < need {
		return fmt.Errorf("the fd limit %d is below the %d that %d agents need: raise ulimit -n", lim.Cur, need, o.n)
	}
	ctrlAddr, err := hostport(o.control)
	if err != nil {
		return err
	}
	httpAddr, err := hostport(o.httpURL)
	if err != nil {
		return err
	}

	nw := newNodeWatch(o.admin, o.pidfile)
	res := newResults()
	res.set("n", "%d", o.n)
	res.set("lane", "%v", o.lane)
	up, err := startUpstream()
	if err != nil {
		return err
	}
	defer up.close()
	logs := newLogCounter()
	fc := &fleetConfig{server: o.control, token: o.token, upstream: up.url, noLane: !o.lane, log: zap.New(logs)}

	label := o.label
	if label == "" {
		label = fmt.Sprintf("N=%d, data lane %v", o.n, map[bool]string{true: "on", false: "off"}[o.lane])
	}
	report("== sluice scale bench: %s (%d CPUs, %s)", label, runtime.NumCPU(), runtime.Version())

	// 0. One Advertise of many routes on an empty node.
	logf("Advertise of %d routes against 1, on the empty node (%d each)", o.advRoutes, o.advReps)
	adv0, err := measureAdvertise(ctx, fc, "adv0", o.advRoutes, o.advReps)
	if err != nil {
		return err
	}

	// The node and this process before the agents.
	base, err := nw.snapshot(ctx, true)
	if err != nil {
		return err
	}
	selfBase, selfG0 := selfSnapshot()
	if o.heapBaseOut != "" {
		if err := os.WriteFile(o.heapBaseOut, base.HeapProf, 0o644); err != nil {
			return fmt.Errorf("writing the heap profile: %w", err)
		}
	}

	// 1. N agents: all at once, at -launch-rate, or -connect-window at a time.
	how := "all at once"
	switch {
	case o.connectWindow > 0:
		how = fmt.Sprintf("at most %d connecting at once", o.connectWindow)
	case o.launchRate > 0:
		how = fmt.Sprintf("%.0f a second", o.launchRate)
	}
	logf("starting %d agents (data lane %v), %s", o.n, o.lane, how)
	logs0 := logs.snapshot()
	var fleet []*member
	defer func() {
		logf("stopping %d agents", len(fleet))
		if late := stopAll(fleet, time.Minute); late > 0 {
			logf("%d agents did not stop within a minute", late)
		}
	}()
	cctx, ccancel := context.WithTimeout(ctx, o.connectTimeout)
	progress := func(done int) { logf("connect: %d of %d", done, o.n) }
	var t0 time.Time
	var at []time.Time
	if o.connectWindow > 0 {
		fleet, t0, at, err = launchWindowed(cctx, fc, "scale", o.n, o.connectWindow, progress)
	} else {
		fleet, t0, err = launchAll(fc, "scale", o.n, o.launchRate)
		if err == nil {
			at = watchEstablished(cctx, fleet, nil, 10*time.Millisecond, progress)
		}
	}
	ccancel()
	if err != nil {
		return err
	}
	connect, missing := since(t0, at)
	grown, failed := logs.since(logs0, "WARN", "ERROR")
	if missing > 0 {
		report("connect: %d of %d agents not connected after %.0f s (-connect-timeout %v); agents' log:\n%s",
			missing, o.n, time.Since(t0).Seconds(), o.connectTimeout, summary(grown, 12))
		return fmt.Errorf("%d agents never connected", missing)
	}
	all := percentile(connect, 1)
	report("\n-- connect: %d agents, %s; all connected after %.2f s (%.0f sessions/s)",
		o.n, how, secs(all), float64(o.n)/secs(all))
	report("   per agent from the start: p50 %.2f s, p90 %.2f s, p99 %.2f s, max %.2f s; failed attempts (WARN/ERROR) %d",
		secs(median(connect)), secs(percentile(connect, 0.9)), secs(percentile(connect, 0.99)), secs(all), failed)
	if len(grown) > 0 {
		report("   agents' log while connecting:\n%s", summary(grown, 10))
	}
	res.set("connect_all_s", "%.2f", secs(all))
	res.set("connect_p50_s", "%.2f", secs(median(connect)))
	res.set("connect_p90_s", "%.2f", secs(percentile(connect, 0.9)))
	res.set("connect_failed_attempts", "%d", failed)

	// 2. Idle with all N: the node's cost per session.
	logf("all connected; idle %v, then measuring", o.settle)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(o.settle):
	}
	idle, err := nw.snapshot(ctx, true)
	if err != nil {
		return err
	}
	selfIdle, selfG1 := selfSnapshot()
	if err := perSession(o, res, base, idle, selfBase, selfIdle, selfG0, selfG1); err != nil {
		return err
	}
	if o.heapOut != "" {
		if err := os.WriteFile(o.heapOut, idle.HeapProf, 0o644); err != nil {
			return fmt.Errorf("writing the heap profile: %w", err)
		}
	}
	if err := goroutineReport(ctx, nw, o); err != nil {
		return err
	}

	// 3. The probe's latency with all N idle.
	p := newProber(o.httpURL, hostsOf(0)[0], 5*time.Second)
	var lat []time.Duration
	for range 20 {
		r := p.once()
		if r.status != 200 {
			return fmt.Errorf("probe of %s with %d agents idle: status %d %s", p.host, o.n, r.status, r.err)
		}
		lat = append(lat, r.latency)
	}
	report("\n-- probe (GET / with Host %s, fresh connection) with all idle: median %.2f ms, max %.2f ms", p.host, ms(median(lat)), ms(percentile(lat, 1)))
	res.set("probe_idle_ms", "%.2f", ms(median(lat)))

	// 4. One Advertise of many routes at N sessions.
	logf("Advertise of %d routes against 1, at %d sessions", o.advRoutes, o.n)
	advN, err := measureAdvertise(ctx, fc, "advN", o.advRoutes, o.advReps)
	if err != nil {
		return err
	}
	advReport(res, o, adv0, advN)

	// 5. The reconnection storm.
	if o.storm {
		sig := syscall.SIGTERM
		if o.stormSignal == "KILL" {
			sig = syscall.SIGKILL
		}
		logf("storm: restarting the node (SIG%s) under %d agents", o.stormSignal, o.n)
		logs1 := logs.snapshot()
		r, err := storm(ctx, nw, fleet, stormOptions{
			sig: sig, exitGrace: 60 * time.Second, timeout: o.stormTimeout,
			ctrlAddr: ctrlAddr, httpAddr: httpAddr, httpURL: o.httpURL,
			probeEvery: 100 * time.Millisecond, probeAfter: 3 * time.Second, probeHostIx: 0,
		})
		if err != nil {
			return fmt.Errorf("storm: %w", err)
		}
		grown, failed := logs.since(logs1, "WARN", "ERROR")
		stormReport(res, o, r, grown, failed)
		after, err := nw.snapshot(ctx, true)
		if err != nil {
			return err
		}
		report("   after the storm (GC'd): node RSS %d KiB (%.1f KiB per session over the first start's baseline), %.0f goroutines, %.0f sessions",
			after.Proc.RSSKiB, float64(after.Proc.RSSKiB-base.Proc.RSSKiB)/float64(o.n), after.Goroutines, after.Sessions)
		res.set("storm_after_rss_per_session_kib", "%.1f", float64(after.Proc.RSSKiB-base.Proc.RSSKiB)/float64(o.n))
	}

	if o.resultsOut != "" {
		if err := res.write(o.resultsOut); err != nil {
			return err
		}
	}
	return nil
}

// selfSnapshot returns this process's status and goroutines after a GC
// that returns freed memory to the system.
func selfSnapshot() (procStatus, int) {
	runtime.GC()
	debug.FreeOSMemory()
	ps, _ := readProc(os.Getpid())
	return ps, runtime.NumGoroutine()
}

// perSession reports the node's and the agents' cost per idle session.
func perSession(o options, res *results, base, idle nodeSnapshot, selfBase, selfIdle procStatus, g0, g1 int) error {
	n := float64(o.n)
	if int(idle.Sessions-base.Sessions) != o.n {
		report("   WARNING: the node counts %.0f sessions more than before, not %d", idle.Sessions-base.Sessions, o.n)
	}
	rss := float64(idle.Proc.RSSKiB-base.Proc.RSSKiB) / n
	heap := (idle.HeapInuse - base.HeapInuse) / 1024 / n
	stack := (idle.StackInuse - base.StackInuse) / 1024 / n
	gor := (idle.Goroutines - base.Goroutines) / n
	verdict := "PASS"
	if rss > 64 {
		verdict = "MISS"
	}
	report("\n-- the node with %d idle sessions (%.0f on a data lane), after a GC:", o.n, idle.OnLane)
	report("   RSS %d -> %d KiB: %.1f KiB per session (target <= 64 KiB: %s)", base.Proc.RSSKiB, idle.Proc.RSSKiB, rss, verdict)
	report("   Go heap in use %.1f -> %.1f MiB: %.1f KiB per session; goroutine stacks %.1f KiB per session",
		base.HeapInuse/(1<<20), idle.HeapInuse/(1<<20), heap, stack)
	report("   goroutines %.0f -> %.0f: %.2f per session; threads %d -> %d",
		base.Goroutines, idle.Goroutines, gor, base.Proc.Threads, idle.Proc.Threads)
	report("   node CPU from the first agent to the last connected and %v idle: %.1f s (%.2f ms per session)",
		o.settle, secs(idle.Proc.CPU-base.Proc.CPU), ms(idle.Proc.CPU-base.Proc.CPU)/n)
	selfRSS := float64(selfIdle.RSSKiB-selfBase.RSSKiB) / n
	report("-- the agents (this process, apart from the node): RSS %d -> %d KiB: %.1f KiB per agent; %.2f goroutines per agent",
		selfBase.RSSKiB, selfIdle.RSSKiB, selfRSS, float64(g1-g0)/n)
	res.set("node_rss_per_session_kib", "%.1f", rss)
	res.set("node_heap_per_session_kib", "%.1f", heap)
	res.set("node_stack_per_session_kib", "%.1f", stack)
	res.set("node_goroutines_per_session", "%.2f", gor)
	res.set("node_rss_idle_mib", "%.0f", float64(idle.Proc.RSSKiB)/1024)
	res.set("node_cpu_connect_ms_per_session", "%.2f", ms(idle.Proc.CPU-base.Proc.CPU)/n)
	res.set("agent_rss_per_agent_kib", "%.1f", selfRSS)
	res.set("agent_goroutines_per_agent", "%.2f", float64(g1-g0)/n)
	return nil
}

// goroutineReport prints the node's largest goroutine groups with N idle
// sessions, per session.
func goroutineReport(ctx context.Context, nw *nodeWatch, o options) error {
	groups, err := nw.goroutines(ctx)
	if err != nil {
		return err
	}
	report("   the node's goroutines by stack (count, per session, where):")
	for i, g := range groups {
		if i == 10 || g.Count < o.n/10 {
			break
		}
		report("   %7d %5.2f  %s", g.Count, float64(g.Count)/float64(o.n), g.where())
	}
	if o.goroutinesOut != "" {
		body, err := nw.get(ctx, "/debug/pprof/goroutine?debug=1")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.goroutinesOut, body, 0o644); err != nil {
			return fmt.Errorf("writing the goroutine profile: %w", err)
		}
	}
	return nil
}

// advTimes are the times from Run to WaitConnected of agents advertising
// one route and many.
type advTimes struct{ one, many []time.Duration }

// measureAdvertise runs reps agents advertising one route and reps
// advertising routes routes, alternately, one at a time, and times each
// from Run to its first AdvertiseAck (WaitConnected); each is stopped
// before the next starts.
func measureAdvertise(ctx context.Context, fc *fleetConfig, prefix string, routes, reps int) (advTimes, error) {
	var t advTimes
	for rep := range reps {
		for _, k := range []int{1, routes} {
			hosts := make([]string, k)
			for j := range hosts {
				hosts[j] = fmt.Sprintf("r%04d.%s-%d-%d.adv.test", j, prefix, k, rep)
			}
			id := fmt.Sprintf("%s-%d-%d", prefix, k, rep)
			start := time.Now()
			m, err := fc.start(id, hosts)
			if err != nil {
				return t, err
			}
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			err = m.a.WaitConnected(wctx)
			d := time.Since(start)
			cancel()
			if err == nil {
				accepted := 0
				for _, r := range m.a.Status().Routes {
					if r.Ack == agent.AckAccepted {
						accepted++
					}
				}
				if accepted != k {
					err = fmt.Errorf("%d of %d routes accepted", accepted, k)
				}
			}
			m.stop(time.Now().Add(10 * time.Second))
			if err != nil {
				return t, fmt.Errorf("advertising agent %s: %w", id, err)
			}
			if k == 1 {
				t.one = append(t.one, d)
			} else {
				t.many = append(t.many, d)
			}
			time.Sleep(200 * time.Millisecond) // let the node take the session out
		}
	}
	return t, nil
}

func advReport(res *results, o options, adv0, advN advTimes) {
	if o.advReps == 0 {
		return
	}
	line := func(what string, t advTimes) time.Duration {
		d := median(t.many) - median(t.one)
		report("   %s: 1 route %.1f ms, %d routes %.1f ms (medians of %d): one Advertise of %d routes costs %.1f ms more",
			what, ms(median(t.one)), o.advRoutes, ms(median(t.many)), o.advReps, o.advRoutes, ms(d))
		return d
	}
	report("\n-- Advertise, from Run to the AdvertiseAck (WaitConnected):")
	d0 := line("empty node", adv0)
	dN := line(fmt.Sprintf("at %d sessions", o.n), advN)
	report("   one more session at %d sessions costs %.1f ms more than on the empty node (1 route each)", o.n, ms(median(advN.one)-median(adv0.one)))
	res.set("adv1_empty_ms", "%.1f", ms(median(adv0.one)))
	res.set("adv_many_extra_empty_ms", "%.1f", ms(d0))
	res.set("adv1_atN_ms", "%.1f", ms(median(advN.one)))
	res.set("adv_many_extra_atN_ms", "%.1f", ms(dN))
}

func stormReport(res *results, o options, r *stormResult, grown map[string]int, failed int) {
	report("\n-- reconnection storm: node restarted with SIG%s under %d agents (pid %d -> %d)", o.stormSignal, o.n, r.oldPID, r.newPID)
	killed := ""
	if r.killed {
		killed = " (outlived the 60 s grace: SIGKILL)"
	}
	report("   old process gone %.2f s after the signal%s; new one accepting on the control port at %.2f s, the HTTP port at %.2f s",
		secs(r.exited), killed, secs(r.ctrlUp), secs(r.httpUp))
	all := percentile(r.reconnect, 1)
	report("   agents back (from the control port accepting): p50 %.2f s, p90 %.2f s, p99 %.2f s, all %.2f s; %d missing; failed attempts (WARN/ERROR) %d",
		secs(median(r.reconnect)), secs(percentile(r.reconnect, 0.9)), secs(percentile(r.reconnect, 0.99)), secs(all), r.missing, failed)
	report("   reconnect times:\n%s", strings.TrimRight(histogram(r.reconnect,
		[]time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
			64 * time.Second, 128 * time.Second, 256 * time.Second, 512 * time.Second}), "\n"))
	if r.missing > 0 {
		report("   WARNING: %d of %d agents not back within %v", r.missing, o.n, o.stormTimeout)
	}
	if m := r.metrics; m != nil {
		var refused []string
		for k, v := range m {
			if strings.HasPrefix(k, "sluice_tunnel_streams_refused_total{") && v > 0 {
				refused = append(refused, fmt.Sprintf("%s %.0f", k[strings.Index(k, "reason="):len(k)-1], v))
			}
		}
		slices.Sort(refused)
		report("   new node at the end of the wait: %.0f sessions registered, %.0f goroutines; agent streams refused: %s",
			m["sluice_tunnel_sessions"], m["go_goroutines"], strings.Join(refused, ", "))
	}
	report("   new node: peak RSS (VmHWM) %d KiB, largest sampled RSS %d KiB, most goroutines sampled %.0f, CPU %.1f s until all were back",
		r.hwmKiB, r.maxRSSKiB, r.maxGoroutines, secs(r.nodeCPU))
	ps := r.probeSummary()
	report("   probe every 100 ms (Host %s) from the HTTP port accepting: %d sent, %d answered (%d x 200), %d without an answer; latency max %.1f ms, p99 %.1f ms",
		r.probeHost, ps.count, ps.answered, ps.ok, ps.errors, ms(ps.maxLatency), ms(ps.p99Latency))
	if ps.firstOK >= 0 {
		report("   first 200 %.2f s after the HTTP port accepted; %d non-200 after its agent was back", secs(ps.firstOK), ps.notOKAfterBack)
	}
	if ps.errSample != "" {
		report("   a probe without an answer: %s", ps.errSample)
	}
	if len(grown) > 0 {
		report("   agents' log during the storm:\n%s", summary(grown, 10))
	}
	res.set("storm_ctrl_up_s", "%.2f", secs(r.ctrlUp))
	res.set("storm_p50_s", "%.2f", secs(median(r.reconnect)))
	res.set("storm_p90_s", "%.2f", secs(percentile(r.reconnect, 0.9)))
	res.set("storm_all_s", "%.2f", secs(all))
	res.set("storm_missing", "%d", r.missing)
	res.set("storm_failed_attempts", "%d", failed)
	res.set("storm_node_hwm_mib", "%.0f", float64(r.hwmKiB)/1024)
	res.set("storm_node_max_goroutines", "%.0f", r.maxGoroutines)
	res.set("storm_node_cpu_s", "%.1f", secs(r.nodeCPU))
	res.set("storm_probe_max_ms", "%.1f", ms(ps.maxLatency))
	res.set("storm_probe_p99_ms", "%.1f", ms(ps.p99Latency))
	res.set("storm_probe_unanswered", "%d", ps.errors)
}
