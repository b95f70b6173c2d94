package l4module

import (
	"sync"
	"time"
)

// throttle allows one log line per period and counts what it suppressed, so
// a flood of unroutable connections logs once, not once per connection.
type throttle struct {
	every time.Duration

	mu         sync.Mutex
	last       time.Time
	suppressed int
}

func (t *throttle) allow() (bool, int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if !t.last.IsZero() && now.Sub(t.last) < t.every {
		t.suppressed++
		return false, 0
	}
	n := t.suppressed
	t.suppressed = 0
	t.last = now
	return true, n
}
