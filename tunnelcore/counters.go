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
	// Flows counts the datagram flows (flow.go).
	Flows FlowCounters
}

// FlowCounters are the datagram flows of the sessions that share them
// (Counters.Flows): how many are open, what they carried each way, and
// what they dropped, by reason. Each is an atomic add per datagram or per
// flow.
type FlowCounters struct {
	// Opened is the flows opened or accepted so far, Active those open
	// now, IdleEnded those that ended for their idle timeout.
	Opened, Active, IdleEnded atomic.Int64
	// DatagramsSent and BytesSent are the datagrams (and their bytes)
	// queued for the peer; DatagramsReceived and BytesReceived those the
	// peer sent that were queued for a reader.
	DatagramsSent, BytesSent         atomic.Int64
	DatagramsReceived, BytesReceived atomic.Int64
	// DroppedSendQueue, DroppedRecvQueue and DroppedTooLarge are the
	// datagrams dropped by reason: a flow's send queue was full, its
	// receive queue was full (its reader fell behind), or the datagram was
	// larger than MaxDatagram (either way).
	DroppedSendQueue, DroppedRecvQueue, DroppedTooLarge atomic.Int64
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

func datagramsSent(c *FlowCounters) *atomic.Int64     { return &c.DatagramsSent }
func datagramsReceived(c *FlowCounters) *atomic.Int64 { return &c.DatagramsReceived }
func droppedSendQueue(c *FlowCounters) *atomic.Int64  { return &c.DroppedSendQueue }
func droppedRecvQueue(c *FlowCounters) *atomic.Int64  { return &c.DroppedRecvQueue }
func droppedTooLarge(c *FlowCounters) *atomic.Int64   { return &c.DroppedTooLarge }

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
