//go:build linux

package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/agent"
)

// member is one agent of the fleet, running in this process.
type member struct {
	id     string
	a      *agent.Agent
	cancel context.CancelFunc
	done   chan struct{} // closed when Run returned
}

// fleetConfig is what every agent of the fleet shares.
type fleetConfig struct {
	server   string // grpc://127.0.0.1:port
	token    string
	upstream string // http://127.0.0.1:port, the shared upstream
	noLane   bool   // Config.DisableDataLane
	log      *zap.Logger
}

// hostsOf returns the hosts agent i advertises: two, as in the issue.
func hostsOf(i int) []string {
	return []string{fmt.Sprintf("a%05d.scale.test", i), fmt.Sprintf("b%05d.scale.test", i)}
}

// start runs one agent advertising hosts; it returns once Run is under
// way (not connected yet).
func (fc *fleetConfig) start(id string, hosts []string) (*member, error) {
	ups := make([]agent.Upstream, len(hosts))
	for i, h := range hosts {
		ups[i] = agent.Upstream{Host: h, Target: fc.upstream}
	}
	cfg := &agent.Config{Server: fc.server, Token: fc.token, ID: id, Upstreams: ups, DisableDataLane: fc.noLane}
	a, err := agent.New(cfg, fc.log)
	if err != nil {
		return nil, fmt.Errorf("agent %s: %w", id, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &member{id: id, a: a, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		_ = a.Run(ctx) // nil once cancelled; a failure shows as no connection
	}()
	return m, nil
}

// stop ends the agent and waits for Run to return until deadline. It
// reports whether it did.
func (m *member) stop(deadline time.Time) bool {
	m.cancel()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-m.done:
		return true
	case <-t.C:
		return false
	}
}

// sessionCounter is Agent.Sessions (sessions acknowledged since the agent
// started), an atomic load. The agent package is being refactored; if the
// method goes, established falls back to Status.
type sessionCounter interface{ Sessions() int64 }

// established returns how many sessions the node acknowledged to the
// agent since it started.
func (m *member) established() int64 {
	if sc, ok := any(m.a).(sessionCounter); ok {
		return sc.Sessions()
	}
	var n int64
	for _, s := range m.a.Status().Sessions {
		n += s.Established
	}
	return n
}

// stopAll stops every member, at most timeout in all; it returns how many
// did not stop in time.
func stopAll(ms []*member, timeout time.Duration) int {
	deadline := time.Now().Add(timeout)
	for _, m := range ms {
		m.cancel()
	}
	late := 0
	for _, m := range ms {
		if !m.stop(deadline) {
			late++
		}
	}
	return late
}

// watchEstablished polls the members every interval until each has more
// sessions than base[i] (base nil: more than 0), or until ctx ends. It
// returns, for each member, when that happened (zero: never), and calls
// progress every 5 s with the count so far.
func watchEstablished(ctx context.Context, ms []*member, base []int64, interval time.Duration, progress func(done int)) []time.Time {
	at := make([]time.Time, len(ms))
	left := len(ms)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	lastReport := time.Now()
	for left > 0 {
		now := time.Now()
		for i, m := range ms {
			if !at[i].IsZero() {
				continue
			}
			var b int64
			if base != nil {
				b = base[i]
			}
			if m.established() > b {
				at[i] = now
				left--
			}
		}
		if left == 0 {
			break
		}
		if progress != nil && time.Since(lastReport) >= 5*time.Second {
			progress(len(ms) - left)
			lastReport = time.Now()
		}
		select {
		case <-ctx.Done():
			return at
		case <-tick.C:
		}
	}
	return at
}

// upstream is the tiny HTTP server every agent's routes point to.
type upstream struct {
	srv *http.Server
	url string
}

func startUpstream() (*upstream, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			fmt.Fprintln(w, "ok")
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() { _ = srv.Serve(ln) }() // ends with close
	return &upstream{srv: srv, url: "http://" + ln.Addr().String()}, nil
}

func (u *upstream) close() { u.srv.Close() }

// launchAll starts n agents at once (or rate a second, when rate > 0)
// with ids prefix-00000... and the hosts of hostsOf, and returns them as
// they started, with the time the first started.
func launchAll(fc *fleetConfig, prefix string, n int, rate float64) ([]*member, time.Time, error) {
	ms := make([]*member, 0, n)
	t0 := time.Now()
	for i := range n {
		if rate > 0 {
			if d := time.Until(t0.Add(time.Duration(float64(i) / rate * float64(time.Second)))); d > 0 {
				time.Sleep(d)
			}
		}
		m, err := fc.start(fmt.Sprintf("%s-%05d", prefix, i), hostsOf(i))
		if err != nil {
			return ms, t0, err
		}
		ms = append(ms, m)
	}
	return ms, t0, nil
}

// launchWindowed starts n agents (as launchAll) with at most window of
// them connecting at once: the next starts when one has connected. It
// returns the members started and when each of the n connected (zero: not
// before ctx ended, or never started), with the time the first started.
func launchWindowed(ctx context.Context, fc *fleetConfig, prefix string, n, window int, progress func(done int)) ([]*member, time.Time, []time.Time, error) {
	ms := make([]*member, 0, n)
	at := make([]time.Time, n)
	sem := make(chan struct{}, window)
	var wg sync.WaitGroup
	var done atomic.Int64
	t0 := time.Now()
	last := t0
	defer wg.Wait()
	for i := range n {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return ms, t0, at, nil
		}
		m, err := fc.start(fmt.Sprintf("%s-%05d", prefix, i), hostsOf(i))
		if err != nil {
			<-sem
			return ms, t0, at, err
		}
		ms = append(ms, m)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if m.a.WaitConnected(ctx) == nil {
				at[i] = time.Now()
				done.Add(1)
			}
		}()
		if progress != nil && time.Since(last) >= 5*time.Second {
			progress(int(done.Load()))
			last = time.Now()
		}
	}
	return ms, t0, at, nil
}
