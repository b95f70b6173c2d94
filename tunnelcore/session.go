package tunnelcore

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Session multiplexes virtual connections over one FrameStream. Both ends of
// a stream run a Session; either may Open connections and the other Accepts
// them (in sluice the node opens and the agent accepts).
type Session struct {
	cfg          Config
	windowLimits windowLimits // from cfg
	stream       FrameStream
	sender       sender

	nextID atomic.Uint64

	mu    sync.Mutex
	conns map[uint64]*Conn

	accept chan *Conn

	buffered atomic.Int64 // bytes received and not yet read, all connections
	minRTT   atomic.Int64 // ns: the smallest round trip a connection's window measured (recvWindow.sessionRTT)
	seedRTT  atomic.Int64 // ns: the owner's estimate before any was measured (SeedRoundTrip)
	spliced  atomic.Int64 // DATA bytes sent by splice (Stats.Spliced)
	direct   atomic.Int64 // connections given a direct socket (Stats.Direct)

	maint *maintainer // nil without a stall timeout or reclaim

	directDialing chan struct{} // direct sockets being opened (takeDirectDial)
	directRetryAt atomic.Int64  // unix ns before which none is opened (after a failure)
	directLog     *logthrottle.Throttle

	done      chan struct{}
	closeOnce sync.Once
	err       error // set before done is closed

	flowLog *logthrottle.Throttle
	peerLog *logthrottle.Throttle // refused Connects and other peer protocol errors
}

// NewSession starts a session on stream. The caller has already exchanged
// whatever handshake precedes it (Advertise/AdvertiseAck) and set
// cfg.PeerWindow from it.
func NewSession(stream FrameStream, cfg Config) (*Session, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Session{
		cfg:          cfg,
		windowLimits: windowLimits{max: int64(cfg.MaxWindow), bdpMax: int64(cfg.MaxBDPWindow)},
		stream:       stream,
		conns:        make(map[uint64]*Conn),
		accept:       acceptBacklog(cfg),
		done:         make(chan struct{}),
		flowLog:      logthrottle.New(10*time.Second, 1),
		peerLog:      logthrottle.New(10*time.Second, 5),

		directDialing: make(chan struct{}, maxDirectDialing),
		directLog:     logthrottle.New(directRetryAfter, 1),
	}
	s.sender.init(s)
	if cfg.Role == RoleAgent {
		s.nextID.Store(1)
	} else {
		s.nextID.Store(0)
	}
	if cfg.StallTimeout > 0 || cfg.ReclaimAfter > 0 {
		s.maint = newMaintainer(s) // before anything can end the session
	}
	go s.recvLoop()
	go s.sender.loop()
	return s, nil
}

// Open opens a virtual connection. It does not wait for the peer: bytes
// written at once travel behind the Connect frame, and a peer that refuses
// the connection answers with an Error that the first Read returns. With
// info.Datagram it opens a datagram flow (flow.go) instead.
func (s *Session) Open(info ConnectInfo) (*Conn, error) {
	info = info.wireSafe()
	var id uint64
	if s.cfg.Role == RoleAgent {
		id = s.nextID.Add(2) - 2
	} else {
		id = s.nextID.Add(2)
	}
	if s.isDone() {
		return nil, s.Err()
	}
	if !s.cfg.Slots.TryAcquire() {
		return nil, ErrConnLimit
	}
	c := newConn(s, id, info, int64(s.cfg.PeerWindow))
	c.slot = true
	var window uint32
	if info.Datagram {
		// No credit either way; window 0 makes a peer that predates
		// flows refuse the Connect instead of taking it for a stream.
		c.flow, c.credit, window = newFlowState(s), 0, 0
	} else {
		window = uint32(c.rwin.openWindow(time.Duration(s.minRTT.Load()), time.Duration(s.seedRTT.Load()), s.cfg.Budget, s.windowLimits))
	}
	s.mu.Lock()
	if s.isDone() {
		s.mu.Unlock()
		c.releaseSlot()
		return nil, s.Err()
	}
	s.conns[id] = c
	s.mu.Unlock()
	c.flow.start(c)
	s.sendConnFrame(c, &tunnelpb.Frame{Kind: &tunnelpb.Frame_Connect{Connect: &tunnelpb.Connect{
		ConnId:     id,
		RouteKey:   info.RouteKey,
		RemoteAddr: info.RemoteAddr,
		LocalAddr:  info.LocalAddr,
		ServerName: info.ServerName,
		Window:     window,
		Datagram:   info.Datagram,
	}}})
	return c, nil
}

// SeedRoundTrip gives the session a first estimate of its round trip,
// measured by its owner before any connection moved bytes (a node: from
// offering the data lane to the lane's hello, at least one round trip).
// Until a connection's probe measures the round trip, windows grow as on
// a path that long (eightfold per decision past a millisecond), and open
// larger only from 10 ms (openWindowSeedMin): an estimate includes the
// agent's own delays, which can make a busy host a millisecond away look
// far. Give an upper bound: one below the real round trip would hold
// windows back.
func (s *Session) SeedRoundTrip(d time.Duration) {
	if d > 0 {
		lowerRoundTrip(&s.seedRTT, d)
	}
}

// acceptBacklog is the channel the peer's connections wait for Accept in;
// none (nil) when the session refuses them.
func acceptBacklog(cfg Config) chan *Conn {
	if cfg.RefuseOpens != "" {
		return nil
	}
	return make(chan *Conn, cfg.AcceptBacklog)
}

// ErrAcceptRefused is Accept's error on a session whose Config.RefuseOpens
// refuses every connection the peer opens.
var ErrAcceptRefused = errors.New("tunnel session refuses the connections its peer opens")

// Accept waits for a connection the peer opened.
func (s *Session) Accept(ctx context.Context) (*Conn, error) {
	if s.accept == nil {
		return nil, ErrAcceptRefused
	}
	select {
	case c := <-s.accept:
		return c, nil
	case <-s.done:
		return nil, s.Err()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// SendControl queues a session-level frame (Advertise, AdvertiseAck, Drain,
// ...) ahead of every connection frame.
func (s *Session) SendControl(f *tunnelpb.Frame) error {
	if s.isDone() {
		return s.Err()
	}
	s.sendPacedControl(f)
	return nil
}

// Flush waits until the control frames queued before it (SendControl's,
// and the session's own) have been handed to the stream: a session frame
// that must reach the peer before the session ends (the answer to a
// Drain) is flushed before CloseWithError, which drops what is queued. It
// returns the session's error if the session ends first, or ctx's.
func (s *Session) Flush(ctx context.Context) error {
	flushed := make(chan struct{})
	q := &s.sender
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return s.Err()
	}
	q.ctrl.push(ctrlItem{flushed: flushed})
	q.mu.Unlock()
	notify(q.wake)
	select {
	case <-flushed:
		return nil
	case <-s.done:
		return s.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Done is closed when the session has ended.
func (s *Session) Done() <-chan struct{} { return s.done }

// Err returns why the session ended (wrapping ErrSessionClosed), or nil
// while it runs.
func (s *Session) Err() error {
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

func (s *Session) isDone() bool { return isClosedChan(s.done) }

// Close ends the session and fails every open connection.
func (s *Session) Close() error {
	s.CloseWithError(errors.New("closed locally"))
	return nil
}

// CloseWithError ends the session with cause, which every open connection's
// error wraps together with ErrSessionClosed.
func (s *Session) CloseWithError(cause error) {
	s.closeOnce.Do(func() {
		s.err = &sessionError{cause: cause}
		s.mu.Lock()
		close(s.done)
		conns := make([]*Conn, 0, len(s.conns))
		for _, c := range s.conns {
			conns = append(conns, c)
		}
		s.mu.Unlock()
		s.stream.Close(cause)
		s.sender.shutdown()
		if s.maint != nil {
			s.maint.stop()
		}
		for _, c := range conns {
			c.onSessionEnd(s.err)
			s.removeConn(c)
		}
		s.drainAccept()
		if !errors.Is(cause, context.Canceled) {
			s.cfg.Logger.Debug("tunnel session ended", zap.Error(cause), zap.Int("connections", len(conns)))
		}
	})
}

// drainAccept fails connections that were opened but never accepted.
func (s *Session) drainAccept() {
	for {
		select {
		case c := <-s.accept:
			c.onSessionEnd(s.err)
		default:
			return
		}
	}
}

// ErrStalled ends a session whose stream took no frame for
// Config.StallTimeout while frames waited (and, with Config.Progress, whose
// transport delivered no data meanwhile).
var ErrStalled = errors.New("tunnel stream stalled: a send waited past the stall timeout while the connection moved no data")

// maintainer runs the stall watchdog and the window reclaim every period
// until the session ends. It is a timer that re-arms itself rather than a
// goroutine waiting on a ticker: a node holds one per agent session, and
// an idle session should cost no stack. Ticks run one at a time (the next
// is armed when one is done), so moved needs no lock.
type maintainer struct {
	s      *Session
	period time.Duration

	mu    sync.Mutex
	timer *time.Timer  // guarded by mu: armed for the next tick
	moved progressMark // guarded by mu
}

// newMaintainer arms a maintainer for s.
func newMaintainer(s *Session) *maintainer {
	period := 250 * time.Millisecond
	if st := s.cfg.StallTimeout; st > 0 && st/4 < period {
		period = max(st/4, 5*time.Millisecond)
	}
	if ra := s.cfg.ReclaimAfter; ra > 0 && ra/4 < period {
		period = max(ra/4, 5*time.Millisecond)
	}
	m := &maintainer{s: s, period: period}
	m.mu.Lock()
	m.timer = time.AfterFunc(period, m.tick)
	m.mu.Unlock()
	return m
}

// stop cancels the next tick (the session ended).
func (m *maintainer) stop() {
	m.mu.Lock()
	m.timer.Stop()
	m.mu.Unlock()
}

// tick is one round of maintenance, then arms the next unless the session
// ended (a tick armed as it ended finds it done and does nothing).
func (m *maintainer) tick() {
	s := m.s
	if s.isDone() {
		return
	}
	now := time.Now()
	// The socket is read only while a Send is in progress: an idle
	// session costs no syscall.
	since := s.sender.sendingSince.Load()
	m.mu.Lock()
	if since != 0 {
		m.moved.observe(s.cfg.Progress, now)
	} else {
		m.moved = progressMark{}
	}
	movedAt := m.moved.at
	m.mu.Unlock()
	if s.stalled(now, since, movedAt) {
		s.cfg.Logger.Warn("tunnel stream stalled; failing the session",
			zap.Duration("stall_timeout", s.cfg.StallTimeout), zap.Int64("queued_bytes", s.Stats().Queued))
		s.CloseWithError(ErrStalled)
		return
	}
	if s.cfg.ReclaimAfter > 0 {
		s.reclaimIdle(now)
	}
	m.mu.Lock()
	m.timer.Reset(m.period) // a Stop since the isDone check: the tick finds it done
	m.mu.Unlock()
}

// stalled reports whether the Send in progress since sendingSince (unix
// nanos, 0: none) has been blocked past the stall timeout while the
// transport moved less than stallProgressStep since movedAt (with no
// Config.Progress, the blocked Send decides alone).
func (s *Session) stalled(now time.Time, sendingSince int64, movedAt time.Time) bool {
	st := s.cfg.StallTimeout
	if st <= 0 || sendingSince == 0 || now.Sub(time.Unix(0, sendingSince)) <= st {
		return false
	}
	return s.cfg.Progress == nil || now.Sub(movedAt) > st
}

// progressMark is when the transport was last seen to deliver
// stallProgressStep bytes during a blocked Send (or when the Send was first
// seen blocked), and its reading then.
type progressMark struct {
	value uint64
	at    time.Time
}

// observe starts the mark, or moves it when the transport delivered a step
// since. A reading below the mark (the socket is gone and reads 0) is no
// progress.
func (m *progressMark) observe(progress func() uint64, now time.Time) {
	var v uint64
	if progress != nil {
		v = progress()
	}
	if m.at.IsZero() || v >= m.value+stallProgressStep {
		*m = progressMark{value: v, at: now}
	}
}

// reclaimIdle asks the peers of idle readers with grown windows to give
// back their credit above InitialWindow.
func (s *Session) reclaimIdle(now time.Time) {
	s.mu.Lock()
	conns := make([]*Conn, 0, len(s.conns))
	for _, c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		if c.shouldReclaim(now, s.cfg.ReclaimAfter) {
			s.sendConnControl(c, &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
				WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.id, ReclaimAbove: InitialWindow},
			}})
		}
	}
}

// Stats is a snapshot of what a session holds.
type Stats struct {
	// Conns is the number of connections in the session's table.
	Conns int
	// Buffered is the bytes received and not yet read, all connections.
	Buffered int64
	// Queued is the bytes of DATA waiting in front of the sender, each
	// frame counted at least minFrameCharge (4 KiB), the buffer it holds.
	Queued int64
	// Spliced is the DATA bytes sent so far that moved from a socket into
	// the stream inside the kernel (splice.go).
	Spliced int64
	// Direct is the connections given a direct socket so far (direct.go).
	Direct int64
}

// Stats returns what the session holds now.
func (s *Session) Stats() Stats {
	s.mu.Lock()
	n := len(s.conns)
	var queued int64
	for _, c := range s.conns {
		queued += c.queued.Load()
	}
	s.mu.Unlock()
	return Stats{Conns: n, Buffered: s.buffered.Load(), Queued: queued, Spliced: s.spliced.Load(), Direct: s.direct.Load()}
}

// Conns returns the connections open on the session.
func (s *Session) Conns() []*Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Conn, 0, len(s.conns))
	for _, c := range s.conns {
		out = append(out, c)
	}
	return out
}

// NumConns returns the number of open connections.
func (s *Session) NumConns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *Session) lookup(id uint64) *Conn {
	s.mu.Lock()
	c := s.conns[id]
	s.mu.Unlock()
	return c
}

// removeConn takes c out of the table and gives back its slot; it runs once
// c ended and its queued frames left the sender (or the session ended).
//
// The one call that takes c out of the table reports its end
// (Config.OnConnEnd): each connection is in the table once.
func (s *Session) removeConn(c *Conn) {
	s.mu.Lock()
	removed := s.conns[c.id] == c
	if removed {
		delete(s.conns, c.id)
	}
	s.mu.Unlock()
	c.releaseSlot()
	if removed && s.cfg.OnConnEnd != nil {
		s.cfg.OnConnEnd(c.endReport())
	}
}

func zapConn(id uint64) zap.Field { return zap.Uint64("conn_id", id) }

func itoa(v uint64) string { return strconv.FormatUint(v, 10) }
