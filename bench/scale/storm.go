//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// probeResult is one probe request through the node's HTTP port.
type probeResult struct {
	sent    time.Time
	latency time.Duration
	status  int // 0: no HTTP answer (err says why)
	err     string
}

// prober sends GET / with one agent's host to the node's HTTP port every
// interval, each on a fresh connection (as curl would), each in its own
// goroutine so a slow answer does not delay the next probe.
type prober struct {
	url, host string
	client    *http.Client
	mu        sync.Mutex
	results   []probeResult
	wg        sync.WaitGroup
}

func newProber(url, host string, timeout time.Duration) *prober {
	return &prober{url: url, host: host, client: &http.Client{
		Timeout:   timeout,
		Transport: &http.Transport{DisableKeepAlives: true, DisableCompression: true},
	}}
}

// once sends one probe and records it.
func (p *prober) once() probeResult {
	r := probeResult{sent: time.Now()}
	req, err := http.NewRequest(http.MethodGet, p.url+"/", nil)
	if err == nil {
		req.Host = p.host
		var resp *http.Response
		if resp, err = p.client.Do(req); err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			r.status = resp.StatusCode
		}
	}
	r.latency = time.Since(r.sent)
	if err != nil {
		r.err = err.Error()
	}
	p.mu.Lock()
	p.results = append(p.results, r)
	p.mu.Unlock()
	return r
}

// run probes every interval until ctx ends, then waits for the probes in
// flight (each bounded by the client's timeout).
func (p *prober) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.once() }()
		select {
		case <-ctx.Done():
			p.wg.Wait()
			return
		case <-t.C:
		}
	}
}

// waitAccepting dials addr every 10 ms until a connection succeeds or ctx
// ends, and returns when it succeeded.
func waitAccepting(ctx context.Context, addr string) (time.Time, error) {
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return time.Now(), nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("%s never accepted: %w", addr, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// stormResult is what a node restart with every agent connected showed.
type stormResult struct {
	signal         string
	oldPID, newPID int
	exited         time.Duration // signal -> old process gone
	killed         bool          // it outlived the grace and got SIGKILL
	ctrlUp, httpUp time.Duration // signal -> the new process accepts on the control / HTTP port
	// reconnect holds each agent's time from ctrlUp to its next
	// acknowledged session; missing counts those that had none by the
	// deadline.
	reconnect []time.Duration
	missing   int
	// hwmKiB is the new process's peak RSS (VmHWM) once every agent was
	// back; maxRSSKiB the largest VmRSS sampled every 100 ms and
	// maxGoroutines the largest go_goroutines sampled every second.
	hwmKiB, maxRSSKiB int64
	maxGoroutines     float64
	nodeCPU           time.Duration // the new process's CPU until every agent was back
	// metrics is the new node's /metrics when the wait for the agents
	// ended (nil if it did not answer).
	metrics    map[string]float64
	probes     []probeResult
	probeHost  string
	probedBack time.Time // when the probed host's agent was back
	upAt       time.Time // the HTTP port accepting again
}

// stormOptions configure storm.
type stormOptions struct {
	sig         syscall.Signal
	exitGrace   time.Duration // how long the old process may take to exit before SIGKILL
	timeout     time.Duration // for every agent to be back, from the new process accepting
	ctrlAddr    string
	httpAddr    string
	httpURL     string
	probeEvery  time.Duration
	probeAfter  time.Duration // probing continues this long after every agent is back
	probeHostIx int           // whose first host the probe asks for
}

// storm restarts the node under every member of ms: it signals the node
// process, waits for it to exit and for its supervisor (the script) to
// start a new one, and measures how the agents come back.
func storm(ctx context.Context, nw *nodeWatch, ms []*member, o stormOptions) (*stormResult, error) {
	r := &stormResult{signal: o.sig.String(), probeHost: hostsOf(o.probeHostIx)[0]}
	pid, err := nw.pid()
	if err != nil {
		return nil, err
	}
	r.oldPID = pid
	base := make([]int64, len(ms))
	for i, m := range ms {
		base[i] = m.established()
	}

	probeCtx, stopProbes := context.WithCancel(ctx)
	p := newProber(o.httpURL, r.probeHost, 5*time.Second)
	probing := make(chan struct{})
	go func() { defer close(probing); p.run(probeCtx, o.probeEvery) }()
	defer func() { stopProbes(); <-probing; r.probes = p.results }()

	t0 := time.Now()
	if err := syscall.Kill(pid, o.sig); err != nil {
		return nil, fmt.Errorf("signalling the node (pid %d): %w", pid, err)
	}
	exitBy := t0.Add(o.exitGrace)
	for alive(pid) {
		if time.Now().After(exitBy) && !r.killed {
			syscall.Kill(pid, syscall.SIGKILL)
			r.killed = true
			exitBy = time.Now().Add(10 * time.Second)
		} else if r.killed && time.Now().After(exitBy) {
			return nil, fmt.Errorf("node process %d outlived SIGKILL by 10 s", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
	r.exited = time.Since(t0)

	upCtx, cancelUp := context.WithTimeout(ctx, time.Minute)
	defer cancelUp()
	var newPID int
	for {
		if np, err := nw.pid(); err == nil && np != pid && alive(np) {
			newPID = np
			break
		}
		select {
		case <-upCtx.Done():
			return nil, errors.New("no new node process within a minute of the old one's exit (is the script's supervisor loop running?)")
		case <-time.After(5 * time.Millisecond):
		}
	}
	r.newPID = newPID

	// Sample the new process: RSS every 100 ms, goroutines every second.
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		lastMetrics := time.Time{}
		for {
			if ps, err := readProc(newPID); err == nil {
				r.maxRSSKiB = max(r.maxRSSKiB, ps.RSSKiB)
			}
			if time.Since(lastMetrics) >= time.Second {
				lastMetrics = time.Now()
				mctx, cancel := context.WithTimeout(sampleCtx, 2*time.Second)
				if m, err := nw.metrics(mctx); err == nil {
					r.maxGoroutines = max(r.maxGoroutines, m["go_goroutines"])
				}
				cancel()
			}
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	defer func() { stopSampling(); <-sampled }()

	ctrlAt, err := waitAccepting(upCtx, o.ctrlAddr)
	if err != nil {
		return nil, err
	}
	r.ctrlUp = ctrlAt.Sub(t0)
	httpAt, err := waitAccepting(upCtx, o.httpAddr)
	if err != nil {
		return nil, err
	}
	r.httpUp, r.upAt = httpAt.Sub(t0), httpAt

	backCtx, cancelBack := context.WithTimeout(ctx, o.timeout)
	defer cancelBack()
	at := watchEstablished(backCtx, ms, base, 20*time.Millisecond, func(done int) {
		logf("storm: %d of %d agents back after %.1f s", done, len(ms), time.Since(ctrlAt).Seconds())
	})
	for i, t := range at {
		if t.IsZero() {
			r.missing++
			continue
		}
		r.reconnect = append(r.reconnect, max(0, t.Sub(ctrlAt)))
		if i == o.probeHostIx {
			r.probedBack = t
		}
	}
	if ps, err := readProc(newPID); err == nil {
		r.hwmKiB, r.nodeCPU = ps.HWMKiB, ps.CPU
	}
	mctx, cancelM := context.WithTimeout(ctx, 30*time.Second)
	r.metrics, _ = nw.metrics(mctx)
	cancelM()
	select { // keep probing a little after the last agent is back
	case <-ctx.Done():
	case <-time.After(o.probeAfter):
	}
	return r, nil
}

// probeSummary is what the probes sent once the node accepted again say.
type probeSummary struct {
	count, answered, ok, errors int
	maxLatency, p99Latency      time.Duration
	firstOK                     time.Duration // from the HTTP port accepting to the first 200; -1: none
	notOKAfterBack              int           // non-200 answers sent after the probed agent was back
	errSample                   string
}

func (r *stormResult) probeSummary() probeSummary {
	s := probeSummary{firstOK: -1}
	var lat []time.Duration
	for _, p := range r.probes {
		if p.sent.Before(r.upAt) {
			continue
		}
		s.count++
		lat = append(lat, p.latency)
		if p.status == 0 {
			s.errors++
			if s.errSample == "" {
				s.errSample = p.err
			}
		} else {
			s.answered++
		}
		if p.status == http.StatusOK {
			s.ok++
			if d := p.sent.Sub(r.upAt); s.firstOK < 0 || d < s.firstOK {
				s.firstOK = d
			}
		} else if !r.probedBack.IsZero() && p.sent.After(r.probedBack) {
			s.notOKAfterBack++
		}
	}
	if len(lat) > 0 {
		s.maxLatency = percentile(lat, 1)
		s.p99Latency = percentile(lat, 0.99)
	}
	return s
}
