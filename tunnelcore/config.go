package tunnelcore

import (
	"context"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Protocol constants.
const (
	// InitialWindow is the receive window every connection starts with in
	// each direction, and the part of a window never charged to a Budget.
	InitialWindow = 64 << 10
	// DefaultMaxWindow is the largest a receive window grows by default.
	// One connection moves at most a window per round trip of the tunnel,
	// so this caps a single transfer: 4 MiB is ~200 MB/s at a 20 ms round
	// trip, where 1 MiB gives ~50. On one host the "round trip" is mostly
	// scheduling delay of a busy reader: a larger window lets the writer
	// run out of credit less often, which moves more bytes for less CPU
	// (bench/http.sh compares sizes; past 4 MiB nothing more is won). Growth past
	// InitialWindow is charged to the Budget, so the node-wide bound on
	// buffered bytes does not move.
	DefaultMaxWindow = 4 << 20
	// DefaultMaxBDPWindow is the largest a receive window grows by default
	// when the tunnel's round trip makes the window the limit (see
	// Config.MaxBDPWindow): 32 MiB is ~320 MB/s at 50 ms, ~160 at 100 ms.
	DefaultMaxBDPWindow = 32 << 20
	// DefaultMaxFrameSize is the largest DATA payload a session sends.
	// Each DATA message costs a fixed amount of CPU on both ends (gRPC's
	// send and receive path, the codec, dispatch), so larger messages move
	// the same bytes for less CPU (BenchmarkStream, FRAME=...). A frame
	// never exceeds the peer's credit, so
	// small windows still get small frames.
	DefaultMaxFrameSize = 256 << 10
	// DefaultSendQueue is what one connection may queue in front of the
	// sender, outside any budget: one full frame waits while the sender
	// writes the previous one, so the writer refills in parallel.
	DefaultSendQueue = DefaultMaxFrameSize
	// DefaultAcceptBacklog is how many opened connections may wait for Accept.
	DefaultAcceptBacklog = 1024
	// DefaultStallTimeout is Config.StallTimeout's default.
	DefaultStallTimeout = 60 * time.Second
	// DefaultReclaimAfter is Config.ReclaimAfter's default.
	DefaultReclaimAfter = time.Second
	// DefaultBudget is the budget a session makes for itself when
	// Config.Budget is nil.
	DefaultBudget = 64 << 20
)

// Role decides which connection ids a session allocates, so both ends may
// open connections without colliding.
type Role int

const (
	// RoleNode opens even connection ids (the Caddy side).
	RoleNode Role = iota
	// RoleAgent opens odd connection ids.
	RoleAgent
)

// Config tunes a Session. The zero value is usable: every field has a
// documented default that Validate fills in.
type Config struct {
	// Role selects the id space of connections this end opens.
	Role Role

	// PeerWindow is the receive window the peer grants each connection
	// this end opens (Advertise.initial_window / AdvertiseAck.initial_window).
	// Default InitialWindow; at least InitialWindow.
	PeerWindow uint32

	// MaxWindow is the largest a receive window may grow to by doubling.
	// Default DefaultMaxWindow; at least InitialWindow.
	MaxWindow int

	// MaxBDPWindow is the largest a receive window may grow to past
	// MaxWindow, and only while the bytes its reader takes per round trip
	// of the tunnel (measured per connection, from a grant to the first
	// byte that needed it) need more than half of it: the bandwidth-delay
	// product of a long path. The Budget bounds it as it bounds every
	// window. Default DefaultMaxBDPWindow; at least MaxWindow (equal: off).
	MaxBDPWindow int

	// MaxFrameSize is the largest DATA payload sent. Default
	// DefaultMaxFrameSize; between 1 KiB and 1 MiB.
	MaxFrameSize int

	// SendQueue bounds the bytes one connection queues in front of the
	// sender. Default DefaultSendQueue; at least MaxFrameSize.
	SendQueue int

	// DatagramQueue bounds what each datagram flow holds queued in each
	// direction (its send queue and its receive queue), each datagram
	// counted by its buffer plus a fixed overhead; a datagram that does
	// not fit is dropped and counted. Default DefaultDatagramQueue; at
	// least one datagram of MaxDatagram.
	DatagramQueue int

	// FlowIdleTimeout ends a datagram flow (Close) that carried no
	// datagram either way for this long, unless the flow sets its own
	// (Conn.SetIdleTimeout). Default DefaultFlowIdleTimeout; negative:
	// never.
	FlowIdleTimeout time.Duration

	// AcceptBacklog bounds the connections the peer opened that wait for
	// Accept; beyond it a Connect is answered with a RESOURCE_EXHAUSTED
	// Error. Default DefaultAcceptBacklog.
	AcceptBacklog int

	// RefuseOpens, when set, answers every connection the peer opens with
	// a REFUSED Error carrying this message, before anything is allocated
	// for it, and Accept fails with ErrAcceptRefused: for an end that has no
	// use for the peer's connections (a node: agents only answer the node's
	// Connects). Such a session holds no accept backlog. Default "" (the
	// peer's connections wait for Accept).
	RefuseOpens string

	// Budget is charged for receive windows above InitialWindow. Share one
	// Budget between all sessions of a node. Nil: the session makes its own
	// of DefaultBudget.
	Budget *Budget

	// Slots bounds the connections open at once (opened and accepted).
	// Share one Slots between all sessions of a node. Nil: no limit.
	Slots *Slots

	// StallTimeout fails the session when one Send to the stream has been
	// blocked this long (the peer stopped reading the stream while still
	// answering keepalives) and, with Progress set, the transport under
	// the stream delivered less than 16 KiB meanwhile (counted from the
	// first check that saw the Send blocked, or the last 16 KiB): a link
	// that moves at least 16 KiB per StallTimeout is never cut, however
	// long one frame takes to drain. A peer that stops reading is then cut
	// once what the transport buffers (gRPC's stream window, the sockets)
	// has drained and StallTimeout passed with nothing moving, which on a
	// slow link is later than the timeout alone. Without Progress the
	// blocked Send decides alone, and a link too slow to drain about one
	// frame plus gRPC's write quota per StallTimeout is cut. The watchdog
	// cannot see a peer that stops reading while the connections' credit
	// still fits in the transport's buffers; those connections stall on
	// their own credit alone. Default DefaultStallTimeout; negative turns
	// the watchdog off.
	StallTimeout time.Duration

	// Progress, when set, reads how many bytes the transport under the
	// stream has delivered to the peer so far (a counter that only grows;
	// ProgressCredentials provides one from the socket). The stall
	// watchdog uses it to tell a stalled peer from a slow link.
	Progress func() uint64

	// ReclaimAfter is how long a reader may take no bytes before its peer
	// is asked to give back the credit above InitialWindow, releasing the
	// budget it holds. Default DefaultReclaimAfter; negative turns it off.
	ReclaimAfter time.Duration

	// OnControl receives every frame that belongs to the session rather
	// than a connection (Advertise, AdvertiseAck, MembershipUpdate, Drain,
	// and Error with conn_id 0). It runs on the receive loop: it must not
	// block. Nil drops them.
	OnControl func(*tunnelpb.Frame)

	// DirectDial, on the end that opens direct sockets (sluice's agent),
	// opens a socket to the peer for connection id and returns it once the
	// peer took it (proto/README §2.5, direct.go). It must give up when
	// ctx ends. Nil: connections stay on the stream.
	DirectDial func(ctx context.Context, id uint64) (net.Conn, error)

	// DirectAbove is how many bytes a connection carries on the stream,
	// both directions together, before DirectDial is tried for it (once).
	// Default DefaultDirectAbove; at least 1.
	DirectAbove int64

	// OnConnEnd, when set, is called exactly once for each virtual
	// connection of the session, opened by either end, once it is fully
	// finished: both directions done or aborted, its frames gone from the
	// sender and its slot released (a connection ends when it is closed,
	// aborted by either end, or its session ends; one never closed stays
	// open). The ConnEnd says who opened it, what it carried and how it
	// ended. It runs off every lock of the session, on the goroutine that
	// finished the connection (the caller of Close or Abort, the session's
	// sender or receive loop, or the one ending the session): it must not
	// block, and hands slow work (a log line, a metric) elsewhere. Nil:
	// nothing is called, at no cost.
	OnConnEnd func(ConnEnd)

	// Counters, when set, counts the session's flow-control events into
	// it: one Counters may be shared by many sessions (a node's), so its
	// totals outlive each. Nil: nothing is counted.
	Counters *Counters

	// Logger receives one line per notable event (a connection failed by
	// the peer's misbehaviour, the session's end). Default zap.NewNop().
	Logger *zap.Logger
}

// Validate fills in defaults and reports the first invalid field. Every
// field is checked here; Progress, OnControl, OnConnEnd, Counters, DirectDial and
// Slots are valid whether set or nil.
func (c *Config) Validate() error {
	if c.Role != RoleNode && c.Role != RoleAgent {
		return fmt.Errorf("tunnelcore: Role %d is neither RoleNode nor RoleAgent", c.Role)
	}
	if c.PeerWindow == 0 {
		c.PeerWindow = InitialWindow
	}
	if c.PeerWindow < InitialWindow {
		return fmt.Errorf("tunnelcore: PeerWindow %d below the protocol minimum %d", c.PeerWindow, InitialWindow)
	}
	if c.MaxWindow == 0 {
		c.MaxWindow = DefaultMaxWindow
	}
	if c.MaxWindow < InitialWindow || c.MaxWindow > 1<<30 {
		return fmt.Errorf("tunnelcore: MaxWindow %d outside [%d, 1GiB]", c.MaxWindow, InitialWindow)
	}
	if c.MaxBDPWindow == 0 {
		c.MaxBDPWindow = max(DefaultMaxBDPWindow, c.MaxWindow)
	}
	if c.MaxBDPWindow < c.MaxWindow || c.MaxBDPWindow > 1<<30 {
		return fmt.Errorf("tunnelcore: MaxBDPWindow %d outside [MaxWindow %d, 1GiB]", c.MaxBDPWindow, c.MaxWindow)
	}
	if c.MaxFrameSize == 0 {
		c.MaxFrameSize = DefaultMaxFrameSize
	}
	if c.MaxFrameSize < 1<<10 || c.MaxFrameSize > 1<<20 {
		return fmt.Errorf("tunnelcore: MaxFrameSize %d outside [1KiB, 1MiB]", c.MaxFrameSize)
	}
	if c.SendQueue == 0 {
		c.SendQueue = max(DefaultSendQueue, c.MaxFrameSize)
	}
	if c.SendQueue < c.MaxFrameSize {
		return fmt.Errorf("tunnelcore: SendQueue %d below MaxFrameSize %d", c.SendQueue, c.MaxFrameSize)
	}
	if err := c.validateFlows(); err != nil {
		return err
	}
	if c.AcceptBacklog == 0 {
		c.AcceptBacklog = DefaultAcceptBacklog
	}
	if c.AcceptBacklog < 0 {
		return fmt.Errorf("tunnelcore: AcceptBacklog %d is negative", c.AcceptBacklog)
	}
	if c.Budget == nil {
		c.Budget = NewBudget(DefaultBudget)
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = DefaultStallTimeout
	}
	if c.ReclaimAfter == 0 {
		c.ReclaimAfter = DefaultReclaimAfter
	}
	if c.DirectAbove == 0 {
		c.DirectAbove = DefaultDirectAbove
	}
	if c.DirectAbove < 0 {
		return fmt.Errorf("tunnelcore: DirectAbove %d is negative", c.DirectAbove)
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return nil
}

// validateFlows fills in and checks the datagram flows' fields.
func (c *Config) validateFlows() error {
	if c.DatagramQueue == 0 {
		c.DatagramQueue = DefaultDatagramQueue
	}
	if least := int(datagramCharge(MaxDatagram)); c.DatagramQueue < least {
		return fmt.Errorf("tunnelcore: DatagramQueue %d below one datagram of %d bytes (%d)", c.DatagramQueue, MaxDatagram, least)
	}
	if c.FlowIdleTimeout == 0 {
		c.FlowIdleTimeout = DefaultFlowIdleTimeout
	}
	return nil
}
