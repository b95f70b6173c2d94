// Package logthrottle keeps floods out of the logs: a Throttle lets a few
// lines through per period and reports, on the next line it lets through,
// how many it suppressed meanwhile. Every sluice component that logs per
// connection or per request (refusals, dial failures, misbehaving peers)
// goes through one.
package logthrottle

import (
	"sync"
	"time"
)

// Throttle allows at most Burst events per Period. The zero value allows
// one event per second. Safe for concurrent use.
type Throttle struct {
	Period time.Duration
	Burst  int

	mu         sync.Mutex
	start      time.Time
	lines      int
	suppressed int
}

// New returns a throttle of burst events per period.
func New(period time.Duration, burst int) *Throttle {
	return &Throttle{Period: period, Burst: burst}
}

// Allow reports whether an event may be logged now and, if so, how many
// were suppressed since the last one allowed.
func (t *Throttle) Allow() (ok bool, suppressed int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	period, burst := t.Period, t.Burst
	if period <= 0 {
		period = time.Second
	}
	if burst <= 0 {
		burst = 1
	}
	now := time.Now()
	if t.start.IsZero() || now.Sub(t.start) >= period {
		t.start, t.lines = now, 0
	}
	if t.lines >= burst {
		t.suppressed++
		return false, 0
	}
	t.lines++
	n := t.suppressed
	t.suppressed = 0
	return true, n
}
