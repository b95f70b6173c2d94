package tunnelcore

import (
	"sync/atomic"
	"time"
)

// Counters are the flow-control events of the sessions that share them
// (Config.Counters), for an operator's metrics: how often credit was
// granted each way, and how often a connection had bytes for its peer and
// waited for credit. Each is one atomic add on a path that already sends
// or handles a frame, never per byte.
type Counters struct {
	// WindowUpdatesSent and WindowUpdatesReceived count the credit grants
	// (WindowUpdate frames with an increment) this end sent and received.
	WindowUpdatesSent     atomic.Int64
	WindowUpdatesReceived atomic.Int64
	// CreditWaits counts the times a writer had bytes for its peer and
	// waited because its connection had no credit left.
	CreditWaits atomic.Int64
}

// count adds one to the counter c picks, unless the session counts
// nothing.
func (s *Session) count(pick func(*Counters) *atomic.Int64) {
	if c := s.cfg.Counters; c != nil {
		pick(c).Add(1)
	}
}

func windowUpdatesSent(c *Counters) *atomic.Int64     { return &c.WindowUpdatesSent }
func windowUpdatesReceived(c *Counters) *atomic.Int64 { return &c.WindowUpdatesReceived }
func creditWaits(c *Counters) *atomic.Int64           { return &c.CreditWaits }

// SendBlockedFor returns how long the send in progress on the session's
// stream has been blocked at now (the stall watchdog's measure), or 0 when
// no send waits.
func (s *Session) SendBlockedFor(now time.Time) time.Duration {
	since := s.sender.sendingSince.Load()
	if since == 0 {
		return 0
	}
	return max(now.Sub(time.Unix(0, since)), 0)
}
