package tunnelcore

import (
	"bytes"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// delayedPipe is Pipe with a fixed one-way delay: a frame sent at t is
// received no earlier than t+delay, as over a long path with room for
// depth frames in flight.
func delayedPipe(delay time.Duration, depth int) (FrameStream, FrameStream) {
	ab := make(chan delayedFrame, depth)
	ba := make(chan delayedFrame, depth)
	done := make(chan struct{})
	once := new(sync.Once)
	return &delayedEnd{out: ab, in: ba, done: done, once: once, delay: delay},
		&delayedEnd{out: ba, in: ab, done: done, once: once, delay: delay}
}

type delayedFrame struct {
	data mem.BufferSlice
	at   time.Time // when it may be received
}

type delayedEnd struct {
	out   chan<- delayedFrame
	in    <-chan delayedFrame
	done  chan struct{}
	once  *sync.Once
	delay time.Duration
}

func (p *delayedEnd) Send(e *tunnelpb.Envelope) error {
	data, err := tunnelpb.Codec{}.Marshal(e)
	if err != nil {
		return err
	}
	select {
	case p.out <- delayedFrame{data: data, at: time.Now().Add(p.delay)}:
		return nil
	case <-p.done:
		data.Free()
		return ErrPipeClosed
	}
}

func (p *delayedEnd) Recv(e *tunnelpb.Envelope) error {
	var f delayedFrame
	select {
	case f = <-p.in:
	case <-p.done:
		return io.EOF
	}
	if wait := time.Until(f.at); wait > 0 {
		timer := time.NewTimer(wait)
		select {
		case <-timer.C:
		case <-p.done:
			timer.Stop()
			f.data.Free()
			return io.EOF
		}
	}
	err := tunnelpb.Codec{}.Unmarshal(f.data, e)
	f.data.Free()
	return err
}

func (p *delayedEnd) Close(error) { p.once.Do(func() { close(p.done) }) }

// peakWindowCharge sends size bytes from node to agent over stream pair
// (node, agent) and returns the most the agent's receive windows held of
// its budget at any read: the window's growth past InitialWindow.
func peakWindowCharge(t *testing.T, a, b FrameStream, size int) int64 {
	t.Helper()
	budget := NewBudget(256 << 20)
	node, err := NewSession(a, Config{Role: RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := NewSession(b, Config{Role: RoleAgent, Budget: budget})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Close(); agent.Close() })

	c, err := node.Open(ConnectInfo{RouteKey: "bulk"})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		chunk := bytes.Repeat([]byte{'x'}, 256<<10)
		for sent := 0; sent < size; sent += len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
		c.CloseWrite()
	}()
	r := accept(t, agent)
	var peak, got int64
	buf := make([]byte, 256<<10)
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		n, err := r.Read(buf)
		got += int64(n)
		peak = max(peak, budget.InUse())
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("read after %d bytes: %v", got, err)
		}
	}
	if got != int64(size) {
		t.Fatalf("received %d of %d bytes", got, size)
	}
	return peak
}

// A connection on a long path grows its window past MaxWindow: at 4 MiB
// per 40 ms round trip it would move at most ~100 MB/s whatever the path.
func TestWindowGrowsPastMaxWindowOnALongPath(t *testing.T) {
	a, b := delayedPipe(20*time.Millisecond, 4096)
	peak := peakWindowCharge(t, a, b, 96<<20)
	if limit := int64(DefaultMaxWindow - InitialWindow); peak <= limit {
		t.Fatalf("window charge peaked at %d bytes, not past MaxWindow's %d", peak, limit)
	}
	if bound := int64(DefaultMaxBDPWindow - InitialWindow); peak > bound {
		t.Fatalf("window charge %d past MaxBDPWindow's %d", peak, bound)
	}
}

// On a short path the round trip is microseconds: the window stays within
// MaxWindow, whose growth is what a busy reader on one host needs.
func TestWindowStaysWithinMaxWindowOnAShortPath(t *testing.T) {
	a, b := Pipe(64)
	peak := peakWindowCharge(t, a, b, 96<<20)
	if limit := int64(DefaultMaxWindow - InitialWindow); peak > limit {
		t.Fatalf("window charge peaked at %d bytes, past MaxWindow's %d", peak, limit)
	}
}

// The probe measures from the grant to the first byte past the credit
// granted before it; bytes within the old credit do not end it.
func TestWindowRoundTripProbe(t *testing.T) {
	w := newRecvWindow(InitialWindow)
	if !w.receive(InitialWindow) {
		t.Fatal("initial credit refused")
	}
	start := time.Now().Add(-30 * time.Millisecond)
	if inc := w.consume(InitialWindow, start, NewBudget(0), windowLimits{max: InitialWindow, bdpMax: InitialWindow}); inc != InitialWindow {
		t.Fatalf("grant %d, want %d", inc, InitialWindow)
	}
	if w.probeMark != InitialWindow || !w.probeAt.Equal(start) {
		t.Fatalf("probe = (%v, %d), want (%v, %d)", w.probeAt, w.probeMark, start, InitialWindow)
	}
	w.receive(1)
	if w.minRTT < 30*time.Millisecond || !w.probeAt.IsZero() {
		t.Fatalf("minRTT %v (probe pending: %v), want >= 30ms and the probe done", w.minRTT, !w.probeAt.IsZero())
	}
}

// Past MaxWindow a window grows only while the bytes taken per round trip
// need it, and is kept while the path needs it even when the writer is not
// blocked.
func TestWindowDecisionsPastMaxWindow(t *testing.T) {
	const mib = 1 << 20
	limits := windowLimits{max: 4 * mib, bdpMax: 32 * mib}
	cases := []struct {
		name      string
		size      int64
		rtt       time.Duration
		taken     int64
		elapsed   time.Duration
		blocked   bool // the writer ran out of credit (the reader waited too)
		decisions int
		want      int64
	}{
		{"window limited on a long path: eightfold", 4 * mib, 40 * time.Millisecond, 2 * mib, 40 * time.Millisecond, true, 1, 32 * mib},
		{"eightfold within bdpMax", 8 * mib, 40 * time.Millisecond, 4 * mib, 40 * time.Millisecond, true, 1, 32 * mib},
		{"window limited on a short path: doubles", 4 * mib, 500 * time.Microsecond, 2 * mib, 300 * time.Microsecond, true, 1, 8 * mib},
		{"grows up to bdpMax", 32 * mib, 10 * time.Millisecond, 16 * mib, 10 * time.Millisecond, true, 1, 32 * mib},
		{"one host stays", 4 * mib, 100 * time.Microsecond, 2 * mib, 2 * time.Millisecond, true, 1, 4 * mib},
		{"nothing measured stays", 4 * mib, 0, 2 * mib, 40 * time.Millisecond, true, 1, 4 * mib},
		{"path needs it: kept", 16 * mib, 40 * time.Millisecond, 8 * mib, 100 * time.Millisecond, false, 2, 16 * mib},
		{"path does not: halved", 32 * mib, 40 * time.Millisecond, 16 * mib, 400 * time.Millisecond, false, 2, 16 * mib},
	}
	for _, tc := range cases {
		budget := NewBudget(1 << 30)
		w := recvWindow{size: tc.size, charged: tc.size - InitialWindow, minRTT: tc.rtt}
		budget.grow(0, w.charged)
		now := time.Now()
		for range tc.decisions {
			w.lastDecision = now.Add(-tc.elapsed)
			w.sinceDecision = tc.taken
			w.peerBlocked, w.readerWaited = tc.blocked, tc.blocked
			w.decide(now, budget, limits)
		}
		if w.size != tc.want {
			t.Errorf("%s: window %d MiB, want %d MiB", tc.name, w.size/mib, tc.want/mib)
		}
	}
}

// A connection starts from the round trip its session measured, and its
// own probes lower the session's: a connection opened on a long path grows
// eightfold from its first decision.
func TestWindowSessionRoundTrip(t *testing.T) {
	var session atomic.Int64
	first := newSessionRecvWindow(InitialWindow, &session, 0)
	if first.minRTT != 0 {
		t.Fatalf("first connection starts from %v, want nothing measured", first.minRTT)
	}
	first.receive(InitialWindow)
	first.consume(InitialWindow, time.Now().Add(-40*time.Millisecond), NewBudget(0), windowLimits{max: InitialWindow, bdpMax: InitialWindow})
	first.receive(1)
	if got := time.Duration(session.Load()); got < 40*time.Millisecond {
		t.Fatalf("session round trip %v after a 40 ms probe", got)
	}
	second := newSessionRecvWindow(InitialWindow, &session, 0)
	if second.minRTT != time.Duration(session.Load()) {
		t.Fatalf("second connection starts from %v, want the session's %v", second.minRTT, time.Duration(session.Load()))
	}
	// Its first decision, window bound: 32 KiB taken in 10 ms at a 40 ms
	// round trip needs far more than 64 KiB.
	budget := NewBudget(1 << 30)
	second.receive(InitialWindow / 2)
	second.lastDecision = time.Now().Add(-10 * time.Millisecond)
	second.peerBlocked, second.readerWaited = true, true
	second.consume(InitialWindow/2, time.Now(), budget, windowLimits{max: DefaultMaxWindow, bdpMax: DefaultMaxBDPWindow})
	if second.size != 8*InitialWindow {
		t.Fatalf("window after the first decision %d, want %d (eightfold)", second.size, 8*InitialWindow)
	}
}

// A connection opening on a session whose connections measured a long
// round trip announces a larger window, charged to the budget; on a short
// one, with nothing measured, or without a budget, InitialWindow.
func TestWindowOpenOnALongPath(t *testing.T) {
	limits := windowLimits{max: DefaultMaxWindow, bdpMax: DefaultMaxBDPWindow}
	var session atomic.Int64
	for _, measured := range []time.Duration{0, 200 * time.Microsecond} {
		w := newSessionRecvWindow(InitialWindow, &session, 0)
		if got := w.openWindow(measured, 0, NewBudget(64<<20), limits); got != InitialWindow {
			t.Fatalf("measured %v: opens with %d, want %d", measured, got, InitialWindow)
		}
	}
	w := newSessionRecvWindow(InitialWindow, &session, 0)
	budget := NewBudget(64 << 20)
	if got := w.openWindow(40*time.Millisecond, 0, budget, limits); got != openWindowLongPath || budget.InUse() != openWindowLongPath-InitialWindow {
		t.Fatalf("long path: opens with %d charging %d, want %d charging %d", got, budget.InUse(), openWindowLongPath, openWindowLongPath-InitialWindow)
	}
	if !w.receive(openWindowLongPath) || w.receive(1) {
		t.Fatal("the opening window is not the credit the peer holds")
	}
	w = newSessionRecvWindow(InitialWindow, &session, 0)
	if got := w.openWindow(40*time.Millisecond, 0, NewBudget(0), limits); got != InitialWindow {
		t.Fatalf("no budget: opens with %d, want %d", got, InitialWindow)
	}
	// Nothing measured yet: an estimate opens it from 10 ms, not below.
	for seed, want := range map[time.Duration]int64{3 * time.Millisecond: InitialWindow, 25 * time.Millisecond: openWindowLongPath} {
		w = newSessionRecvWindow(InitialWindow, &session, seed)
		if got := w.openWindow(0, seed, NewBudget(64<<20), limits); got != want {
			t.Fatalf("estimated %v: opens with %d, want %d", seed, got, want)
		}
	}
}

// SeedRoundTrip gives new connections a round trip to grow by before any
// probe (below 10 ms they still open at InitialWindow), and a measured one
// takes its place.
func TestSeedRoundTrip(t *testing.T) {
	node, _ := sessionPair(t, transports[0], Config{}, Config{})
	node.SeedRoundTrip(0)
	if node.seedRTT.Load() != 0 {
		t.Fatal("a zero seed was kept")
	}
	node.SeedRoundTrip(5 * time.Millisecond)
	node.SeedRoundTrip(120 * time.Millisecond) // longer: ignored
	c, err := node.Open(ConnectInfo{RouteKey: "x"})
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	size, rtt := c.rwin.size, c.rwin.minRTT
	c.mu.Unlock()
	if size != InitialWindow || rtt != 5*time.Millisecond {
		t.Fatalf("a connection on a session estimated 5 ms away: window %d, round trip %v; want %d, 5ms", size, rtt, InitialWindow)
	}
	lowerRoundTrip(&node.minRTT, 30*time.Millisecond) // a probe measured it
	c, err = node.Open(ConnectInfo{RouteKey: "y"})
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	size, rtt = c.rwin.size, c.rwin.minRTT
	c.mu.Unlock()
	if size != openWindowLongPath || rtt != 30*time.Millisecond {
		t.Fatalf("after a measured 30 ms: window %d, round trip %v; want %d, 30ms", size, rtt, openWindowLongPath)
	}
}

// A probe that measures more than the estimate a window started from is
// still the session's first measured round trip.
func TestProbeAboveTheEstimateIsMeasured(t *testing.T) {
	var session atomic.Int64
	w := newSessionRecvWindow(InitialWindow, &session, 20*time.Millisecond)
	w.receive(InitialWindow)
	w.consume(InitialWindow, time.Now().Add(-30*time.Millisecond), NewBudget(0), windowLimits{max: InitialWindow, bdpMax: InitialWindow})
	w.receive(1)
	if got := time.Duration(session.Load()); got < 30*time.Millisecond {
		t.Fatalf("session round trip %v after a 30 ms probe, want it measured", got)
	}
	if w.minRTT != 20*time.Millisecond {
		t.Fatalf("window round trip %v, want the lower estimate kept", w.minRTT)
	}
}
