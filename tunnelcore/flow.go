package tunnelcore

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Datagram flows (proto/README §6.1): a Conn opened with
// ConnectInfo.Datagram carries whole datagrams, one per DATA frame, instead
// of a byte stream. A flow takes no part in credit. Each direction has a
// bounded queue instead (Config.DatagramQueue): the writer's in front of
// the sender, the reader's behind the receive loop. A datagram that does
// not fit is dropped, the newest one, and counted: UDP loses datagrams
// rather than wait, and a flow that waited would hold up the session (the
// receive loop) or its writer (a UDP socket read by one goroutine for all
// its clients, on the node). Nothing of a flow ever blocks: the receive
// loop hands a datagram over or drops it, and WriteDatagram queues it or
// drops it. The sender takes a flow's frames in turn with the
// connections', one frame per turn, so a flooded flow gets a turn as a
// busy connection does and holds up none.
//
// A flow's state hangs off Conn.flow, nil for a connection: the byte
// stream's paths check that one pointer and are otherwise untouched.

// MaxDatagram is the largest datagram a flow carries (a UDP payload never
// exceeds it).
const MaxDatagram = tunnelpb.MaxDatagramSize

// DefaultDatagramQueue is Config.DatagramQueue's default: what one flow
// may hold queued in each direction, each datagram counted by
// datagramCharge. 256 KiB is the send queue a connection has
// (DefaultSendQueue): about 150 datagrams of a 1500-byte MTU, two
// milliseconds of a gigabit stream for a reader that falls behind, or
// three of the largest.
const DefaultDatagramQueue = 256 << 10

// DefaultFlowIdleTimeout is Config.FlowIdleTimeout's default: a flow that
// carried no datagram either way for this long ends (a UDP "connection"
// has no end of its own; 60 s is what stateful firewalls commonly keep a
// UDP mapping for after a reply).
const DefaultFlowIdleTimeout = 60 * time.Second

// datagramOverhead is what a queued datagram costs beyond its bytes: its
// envelope or queue entry and the buffer's header.
const datagramOverhead = 128

// Sentinel errors of datagram flows; check them with errors.Is.
var (
	// ErrDatagramTooLarge: WriteDatagram was given more than MaxDatagram
	// bytes.
	ErrDatagramTooLarge = errors.New("datagram larger than 65535 bytes")
	// ErrDatagramDropped: the flow's send queue was full, and the datagram
	// was dropped (and counted).
	ErrDatagramDropped = errors.New("datagram dropped: the flow's send queue is full")
	// ErrNotFlow: a datagram call on a connection that is no flow.
	ErrNotFlow = errors.New("not a datagram flow")
)

// flowState is what a datagram flow adds to its Conn.
type flowState struct {
	// lastActive is when a datagram last went either way (unix nanos);
	// idle is the flow's idle timeout (nanos, <= 0: none).
	lastActive atomic.Int64
	idle       atomic.Int64

	// Per-flow counts (FlowStats).
	sent, received                atomic.Int64
	dropSend, dropRecv, dropLarge atomic.Int64
	idled                         atomic.Bool
	counters                      *FlowCounters // the session's, or nil

	// held is the charge (datagramCharge) of the datagrams in the Conn's
	// receive queue; guarded by Conn.mu.
	held int64

	// mu guards the idle timer. Conn.mu → flowState.mu.
	mu      sync.Mutex
	timer   *time.Timer
	started bool // counted active, timer armed
	stopped bool // the flow ended: no timer any more
}

// newFlowState returns the state of a new flow of s, idle timeout the
// session's default; start arms it once the flow is in the table.
func newFlowState(s *Session) *flowState {
	f := &flowState{}
	f.lastActive.Store(time.Now().UnixNano())
	f.idle.Store(int64(s.cfg.FlowIdleTimeout))
	if s.cfg.Counters != nil {
		f.counters = &s.cfg.Counters.Flows
	}
	return f
}

// datagramCharge is what a datagram of n bytes counts against its flow's
// queue: the buffer it is held in (exact below the pool's smallest tier,
// else its tier, see newDatagramBuffer) plus datagramOverhead.
func datagramCharge(n int) int64 {
	if n < minFrameCharge {
		return int64(n) + datagramOverhead
	}
	return int64(bufferSize(n)) + datagramOverhead
}

// dataCharge is what a DATA frame of n payload bytes counts against c's
// queue allowance (Conn.queued).
func (c *Conn) dataCharge(n int) int64 {
	if c.flow != nil {
		return datagramCharge(n)
	}
	return frameCharge(int64(n))
}

// newDatagramBuffer returns a buffer holding a copy of the n bytes of
// parts: a small datagram gets a buffer of its size (a DNS query in a
// pool buffer would hold 4 KiB), a larger one a buffer of its pool tier.
func newDatagramBuffer(n int, parts ...[]byte) mem.Buffer {
	if n < minFrameCharge {
		b := make([]byte, 0, n)
		for _, p := range parts {
			b = append(b, p...)
		}
		return mem.SliceBuffer(b)
	}
	buf := bufferPool.Get(n)
	off := 0
	for _, p := range parts {
		off += copy((*buf)[off:], p)
	}
	return mem.NewBuffer(buf, bufferPool)
}

// Datagram reports whether c is a datagram flow.
func (c *Conn) Datagram() bool { return c.flow != nil }

// touch records a datagram going either way, for the idle timeout.
func (f *flowState) touch() { f.lastActive.Store(time.Now().UnixNano()) }

// count adds one to a per-flow counter and to the session's.
func (f *flowState) count(mine *atomic.Int64, pick func(*FlowCounters) *atomic.Int64) {
	mine.Add(1)
	if f.counters != nil {
		pick(f.counters).Add(1)
	}
}

// start counts c's flow as active and arms its idle timer; it runs once c
// is in the session's table. Nil-safe: a connection has no flow.
func (f *flowState) start(c *Conn) {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped || f.started {
		return // ended before it started (a refusal)
	}
	f.started = true
	if f.counters != nil {
		f.counters.Opened.Add(1)
		f.counters.Active.Add(1)
	}
	if d := time.Duration(f.idle.Load()); d > 0 {
		f.timer = time.AfterFunc(d, c.checkIdle)
	}
}

// stop ends the flow's timer and its count as active; it runs when c
// leaves lifeOpen, under Conn.mu. Nil-safe.
func (f *flowState) stop() {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return
	}
	f.stopped = true
	if f.timer != nil {
		f.timer.Stop()
	}
	if f.started && f.counters != nil {
		f.counters.Active.Add(-1)
	}
}

// SetIdleTimeout sets how long flow c may carry no datagram either way
// before it ends (Close): a route's own timeout, in place of the session's
// Config.FlowIdleTimeout. d == 0 restores the session's; d < 0 turns it
// off. It errs with ErrNotFlow on a connection.
func (c *Conn) SetIdleTimeout(d time.Duration) error {
	f := c.flow
	if f == nil {
		return ErrNotFlow
	}
	if d == 0 {
		d = c.s.cfg.FlowIdleTimeout
	}
	f.idle.Store(int64(d))
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped || !f.started {
		return nil // start arms it with the new value
	}
	switch {
	case d <= 0 && f.timer != nil:
		f.timer.Stop()
	case d > 0 && f.timer == nil:
		f.timer = time.AfterFunc(f.idleLeft(d), c.checkIdle)
	case d > 0:
		f.timer.Reset(f.idleLeft(d))
	}
	return nil
}

// idleLeft is how long until the flow has been idle for d.
func (f *flowState) idleLeft(d time.Duration) time.Duration {
	return max(d-time.Since(time.Unix(0, f.lastActive.Load())), 0)
}

// checkIdle runs when c's idle timer fires: the flow ends if it carried
// nothing for its timeout, else the timer waits out the rest. Each
// datagram only stores a time (touch): the timer is reset once per
// timeout at most, not per datagram.
func (c *Conn) checkIdle() {
	f := c.flow
	d := time.Duration(f.idle.Load())
	f.mu.Lock()
	if f.stopped || d <= 0 {
		f.mu.Unlock()
		return
	}
	if left := f.idleLeft(d); left > 0 {
		f.timer.Reset(left)
		f.mu.Unlock()
		return
	}
	f.mu.Unlock()
	if !f.idled.Swap(true) && f.counters != nil {
		f.counters.IdleEnded.Add(1)
	}
	c.Close()
}

// FlowStats are the datagrams of one flow: what went each way, what was
// dropped and why, and whether it ended idle.
type FlowStats struct {
	// Sent is the datagrams queued for the peer, Received those the peer
	// sent that were queued for the reader.
	Sent, Received int64
	// DroppedSendQueue, DroppedRecvQueue and DroppedTooLarge are the
	// datagrams dropped because the send queue was full, because the
	// receive queue was full (the reader fell behind), and because they
	// were larger than MaxDatagram (either way).
	DroppedSendQueue, DroppedRecvQueue, DroppedTooLarge int64
	// Idle is true once the flow ended for its idle timeout.
	Idle bool
}

// FlowStats returns the counts of flow c (zero for a connection).
func (c *Conn) FlowStats() FlowStats {
	f := c.flow
	if f == nil {
		return FlowStats{}
	}
	return FlowStats{
		Sent: f.sent.Load(), Received: f.received.Load(),
		DroppedSendQueue: f.dropSend.Load(), DroppedRecvQueue: f.dropRecv.Load(), DroppedTooLarge: f.dropLarge.Load(),
		Idle: f.idled.Load(),
	}
}

// errTooLarge is ErrDatagramTooLarge for a datagram of n bytes.
func errTooLarge(n int) error {
	return fmt.Errorf("%w: %d bytes", ErrDatagramTooLarge, n)
}
