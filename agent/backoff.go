package agent

import (
	"math/rand/v2"
	"time"
)

// Default reconnect backoff: the ceiling starts at 1 s and doubles up to 30 s.
const (
	defaultBackoffInitial = time.Second
	defaultBackoffMax     = 30 * time.Second
)

// backoff is jittered exponential backoff: each wait is drawn uniformly from
// the upper half [ceiling/2, ceiling] of the current ceiling, and the ceiling
// then doubles up to max. Reset brings the ceiling back to initial.
//
// A backoff is not safe for concurrent use.
type backoff struct {
	initial, max time.Duration
	ceiling      time.Duration
	// randN returns a uniform value in [0, n); n > 0.
	randN func(n int64) int64
}

// newBackoff returns a backoff from initial doubling to max. randN may be
// nil (math/rand/v2).
func newBackoff(initial, max time.Duration, randN func(int64) int64) *backoff {
	if initial <= 0 {
		initial = defaultBackoffInitial
	}
	if max < initial {
		max = initial
	}
	if randN == nil {
		randN = rand.Int64N
	}
	return &backoff{initial: initial, max: max, ceiling: initial, randN: randN}
}

// Next returns the next wait and raises the ceiling.
func (b *backoff) Next() time.Duration {
	c := b.ceiling
	lo := c / 2
	d := lo + time.Duration(b.randN(int64(c-lo)+1))
	b.ceiling = min(2*c, b.max)
	return d
}

// Spread returns the wait before the first attempt after a node's Drain
// that asked its agents to spread their reconnections over d (the Drain's
// reconnect_spread_ms): drawn uniformly from [initial/2, d] when d is above
// the current ceiling, so that the agents of a node with many do not all
// come back at once; else the wait Next returns. Either way the ceiling
// rises as with Next, so an attempt that fails backs off as after any
// other wait.
func (b *backoff) Spread(d time.Duration) time.Duration {
	if d <= b.ceiling {
		return b.Next()
	}
	lo := b.initial / 2
	w := lo + time.Duration(b.randN(int64(d-lo)+1))
	b.ceiling = min(2*b.ceiling, b.max)
	return w
}

// Ceiling returns the ceiling the next wait is drawn under.
func (b *backoff) Ceiling() time.Duration { return b.ceiling }

// Reset brings the ceiling back to its initial value.
func (b *backoff) Reset() { b.ceiling = b.initial }
