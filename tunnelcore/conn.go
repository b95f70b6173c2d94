package tunnelcore

import (
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// ConnectInfo describes a virtual connection as its opener announced it.
type ConnectInfo struct {
	// RouteKey names the route the connection was routed to.
	RouteKey string
	// RemoteAddr is the public client's address (host:port), if known.
	RemoteAddr string
	// LocalAddr is the address the public client connected to, if known.
	LocalAddr string
	// ServerName is the TLS SNI of a passthrough connection.
	ServerName string
	// Datagram marks a datagram flow (flow.go): whole datagrams, no
	// credit, bounded queues that drop.
	Datagram bool
	// Tag is the opener's own, never sent: what it uses the connection
	// for (the node marks its pooled HTTP connections with it).
	Tag any
}

// wireSafe returns info with its strings made valid UTF-8. They come from
// public clients (a TLS SNI is any bytes the ClientHello holds), and
// protobuf refuses to marshal a string field that is not UTF-8: sent as
// is, one client's bytes would fail the Connect frame, and with it the
// whole session.
func (info ConnectInfo) wireSafe() ConnectInfo {
	info.RouteKey = strings.ToValidUTF8(info.RouteKey, "\uFFFD")
	info.RemoteAddr = strings.ToValidUTF8(info.RemoteAddr, "\uFFFD")
	info.LocalAddr = strings.ToValidUTF8(info.LocalAddr, "\uFFFD")
	info.ServerName = strings.ToValidUTF8(info.ServerName, "\uFFFD")
	return info
}

// connLife is where a connection is in its life. Closing (Close) and
// breaking (the peer's abort, the session's end) are independent: either
// may come first, and a connection that had both is lifeEnded. Aborting it
// here (fail) closes and breaks it at once, for good.
type connLife uint8

const (
	lifeOpen    connLife = iota // in use
	lifeClosed                  // Close ran; nothing broke it
	lifeBroken                  // the peer aborted it or its session ended; Close has not run
	lifeEnded                   // Close ran and it broke, in either order
	lifeAborted                 // this end aborted it (fail)
)

// closed reports whether Close (or an abort) ran.
func (l connLife) closed() bool { return l == lifeClosed || l >= lifeEnded }

// broken reports whether the connection was aborted by either end or its
// session ended.
func (l connLife) broken() bool { return l >= lifeBroken }

// close is the state after Close.
func (l connLife) close() connLife {
	switch l {
	case lifeOpen:
		return lifeClosed
	case lifeBroken:
		return lifeEnded
	}
	return l
}

// broke is the state after the peer's abort or the session's end.
func (l connLife) broke() connLife {
	switch l {
	case lifeOpen:
		return lifeBroken
	case lifeClosed:
		return lifeEnded
	}
	return l
}

// Conn is one virtual connection of a Session. It is a net.Conn with
// half-close (CloseWrite) and deadlines; Read and Write may be called
// concurrently with each other, as on a TCP connection.
//
// Writes are sent only against the credit the peer granted, so a peer that
// stops reading holds back this connection alone. Reads never block the
// session: what arrives is buffered within the window this end granted.
//
// Each direction has a state of its own (recvState, sendState: open,
// ended cleanly, failed, or moved to a direct socket), and the connection
// one for its life (connLife). The locks and their order are in the
// package doc.
type Conn struct {
	s      *Session
	id     uint64
	info   ConnectInfo
	opened time.Time // when the connection was made (ConnEnd)

	// readNotify and writeNotify wake a waiting reader or writer: data, EOF
	// or an error arrived; credit arrived, the queue drained, or an error.
	// They hold one token, so a waiter that finds the end passes it on to
	// the next (concurrent Reads or Writes all end).
	readNotify  chan struct{}
	writeNotify chan struct{}

	rdl, wdl deadline

	// queued is what this connection has in front of the sender, each
	// DATA frame counted by frameCharge. It is decremented by the sender,
	// which does not take mu.
	queued atomic.Int64

	// bytesRead and bytesWritten count payload taken by the reader and
	// handed to the sender or the direct socket (Counts).
	bytesRead, bytesWritten atomic.Int64

	slot      bool         // holds a Slots slot (set before c is shared)
	slotState atomic.Int32 // slotHeld, slotClosing or slotReleased

	// sendSched is c's place in the sender's queues (sender.go), guarded
	// by the sender's mu.
	sendSched

	// direct is c's direct socket (direct.go), nil until one is being
	// opened or attached: the one thing the read and write paths check
	// for it.
	direct atomic.Pointer[directSocket]

	// wlock is held by Write and ReadFrom (lockWrites): writes are
	// serialised, and the writer that finds a direct socket attached
	// moves the direction.
	wlock chan struct{}

	// flow is c's datagram flow state (flow.go), nil for a connection: the
	// one thing the byte stream's paths check for it. Set before c is
	// shared.
	flow *flowState

	// mu guards the fields below.
	mu         sync.Mutex
	life       connLife
	endHow     ConnOutcome   // how c left lifeOpen (set then, with endErr)
	endErr     error         // the error it ended with, if any
	ended      chan struct{} // closed when c leaves lifeOpen
	brokenHook func()        // run once when c breaks (whenBroken)

	// receive direction (conn_recv.go)
	recvQueue       // received payloads: rq and the open chunk (recvbuf.go)
	buffered  int64 // bytes received and not yet consumed (including those WriteTo holds)
	taken     int64 // bytes WriteTo took out of rq, still counted in buffered
	batch     int   // SetWriteToBatch; 0: writeToBatch
	rwin      recvWindow
	rstate    recvState
	rerr      error // why reads fail, in recvFailed

	// send direction (conn_send.go)
	credit      int64
	blockedSent bool // told the peer we ran out of credit since its last grant
	wstate      sendState
	werr        error // why writes fail, in sendFailed
}

func newConn(s *Session, id uint64, info ConnectInfo, credit int64) *Conn {
	now := time.Now()
	c := &Conn{
		s:           s,
		id:          id,
		info:        info,
		opened:      now,
		readNotify:  make(chan struct{}, 1),
		writeNotify: make(chan struct{}, 1),
		wlock:       make(chan struct{}, 1),
		ended:       make(chan struct{}),
		rdl:         makeDeadline(),
		wdl:         makeDeadline(),
		rwin:        newSessionRecvWindow(InitialWindow, &s.minRTT, time.Duration(s.seedRTT.Load())),
		credit:      credit,
	}
	c.rwin.lastConsume = now
	return c
}

// The states of a connection's slot: held while it runs, closing once it
// began to end (Slots.Closing counts it), released once given back.
const (
	slotHeld int32 = iota
	slotClosing
	slotReleased
)

// markSlotClosing marks c's slot as about to come back (see Slots.WaitFree).
func (c *Conn) markSlotClosing() {
	if !c.slot {
		return
	}
	// Count first: counted after the state changed, a release in between
	// would uncount it before it was counted, and a waiter would read no
	// slot closing while this one is.
	c.s.cfg.Slots.beginClosing()
	if !c.slotState.CompareAndSwap(slotHeld, slotClosing) {
		c.s.cfg.Slots.endClosing()
	}
}

func (c *Conn) releaseSlot() {
	if !c.slot {
		return
	}
	switch c.slotState.Swap(slotReleased) {
	case slotHeld:
		c.s.cfg.Slots.Release()
	case slotClosing:
		// Release before endClosing: a waiter that sees no slot closing
		// gives up, so the slot must be free by then.
		c.s.cfg.Slots.Release()
		c.s.cfg.Slots.endClosing()
	}
}

func notify(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// ID returns the connection id on the wire.
func (c *Conn) ID() uint64 { return c.id }

// Info returns what the opener announced about the connection.
func (c *Conn) Info() ConnectInfo { return c.info }

// Session returns the session the connection belongs to.
func (c *Conn) Session() *Session { return c.s }

// OpenedHere reports whether this end opened c (Session.Open), not the
// peer.
func (c *Conn) OpenedHere() bool { return c.openedHere() }

// openedHere reports whether this end opened c (Session.Open): each end
// opens ids of its own parity.
func (c *Conn) openedHere() bool {
	return (c.id%2 == 1) == (c.s.cfg.Role == RoleAgent)
}

// endLocked moves c to life to. The first move away from lifeOpen records
// how c ended and wakes what waits for that (a writer waiting for the
// write lock, a failed socket call waiting for the peer's word). It
// returns the whenBroken hook to run if c broke just now.
func (c *Conn) endLocked(to connLife, how ConnOutcome, err error) func() {
	from := c.life
	c.life = to
	if from == lifeOpen {
		c.endHow, c.endErr = how, err
		close(c.ended)
		c.flow.stop()
	}
	if from.broken() || !to.broken() {
		return nil
	}
	f := c.brokenHook
	c.brokenHook = nil
	return f
}

// failRecvLocked fails the receive direction with err unless it failed
// already.
func (c *Conn) failRecvLocked(err error) {
	if c.rstate != recvFailed {
		c.rstate, c.rerr = recvFailed, err
	}
}

// failSendLocked fails the send direction with err unless it failed
// already.
func (c *Conn) failSendLocked(err error) {
	if c.wstate != sendFailed {
		c.wstate, c.werr = sendFailed, err
	}
}

// Close implements net.Conn: bytes already written are still delivered,
// followed by EOF; if the peer was still sending, it is told to stop.
func (c *Conn) Close() error {
	c.mu.Lock()
	if c.life.closed() {
		c.mu.Unlock()
		return nil
	}
	c.endLocked(c.life.close(), ConnClosed, nil)
	d := c.direct.Load()
	peerDone := c.rstate == recvEOF || d.readEOF()
	sendFIN := c.wstate == sendOpen
	cancelPeer := !peerDone && c.rstate != recvFailed && c.wstate != sendFailed
	c.failSendLocked(ErrConnClosed)
	c.failRecvLocked(ErrConnClosed) // reads fail with ErrConnClosed from now on
	c.dropBufferedLocked()
	c.rwin.release(c.s.cfg.Budget)
	sock := d.closeLocked()
	c.mu.Unlock()
	if sock != nil {
		closeSocket(sock, false, peerDone, d.socketReadersGone())
	}

	c.rdl.stop()
	c.wdl.stop()
	notify(c.readNotify)
	notify(c.writeNotify)
	if sendFIN {
		c.s.sendFIN(c)
	}
	if cancelPeer {
		c.s.sendConnFrame(c, errorFrame(c.id, tunnelpb.Error_CANCELED, "connection closed"))
	}
	c.s.finish(c)
	return nil
}

func (c *Conn) dropBufferedLocked() {
	c.sealOpenLocked()
	for c.rq.len() > 0 {
		c.rq.pop().Free()
	}
	c.s.buffered.Add(-c.buffered)
	c.buffered = 0
	c.taken = 0
	if c.flow != nil {
		c.flow.held = 0
	}
}

// Abort ends the connection at once in both directions: queued bytes are
// dropped and the peer gets an Error frame with code and message.
func (c *Conn) Abort(code tunnelpb.Error_Code, message string) {
	c.fail(ErrConnClosed, code, message)
}

// fail ends the connection locally with err and tells the peer (unless
// code is UNSPECIFIED, for failures the peer already knows about).
func (c *Conn) fail(err error, code tunnelpb.Error_Code, message string) {
	c.mu.Lock()
	if c.life == lifeAborted {
		c.mu.Unlock()
		return
	}
	hook := c.endLocked(lifeAborted, failOutcome(err), err)
	// Reads fail from now on, also after the peer's FIN: what it sent is
	// dropped, and a clean EOF would pass the loss off as the whole stream.
	c.failRecvLocked(err)
	if c.werr == ErrConnClosed {
		c.werr = err // Close's error gives way to the reason for the abort
	}
	c.failSendLocked(err)
	c.rwin.release(c.s.cfg.Budget)
	c.dropBufferedLocked()
	d := c.direct.Load()
	sock := d.closeLocked()
	c.mu.Unlock()
	closeSocket(sock, true, false, nil)
	runHook(hook)
	c.wake()
	c.s.purge(c)
	if code != tunnelpb.Error_UNSPECIFIED {
		// Paced: a peer could open connections that fail at once, one
		// after the other, each leaving an Error behind.
		c.s.sendPacedControl(errorFrame(c.id, code, message))
	}
	c.s.finish(c)
}

func (c *Conn) wake() {
	notify(c.readNotify)
	notify(c.writeNotify)
}

// onPeerError is called when the peer aborted the connection.
func (c *Conn) onPeerError(e *tunnelpb.Error) {
	perr := &PeerError{Code: e.GetCode(), Message: e.GetMessage()}
	how := ConnPeerAborted
	if c.openedHere() && refusal(e.GetCode()) {
		how = ConnRefused
	}
	c.mu.Lock()
	hook := c.endLocked(c.life.broke(), how, perr)
	d := c.direct.Load()
	// A direction on the direct socket ends as the socket tells: the
	// peer's FIN after its last bytes (its Close), or a reset (its abort).
	if c.rstate == recvOpen && !d.readMoved() {
		c.rstate, c.rerr = recvFailed, perr
	}
	shut := !c.life.closed() && d.writeMoved()
	c.failSendLocked(perr) // after Close, its ErrConnClosed stays
	// The window grows no more (nothing is granted once reads failed), and
	// c leaves the session's table now: a later session end would not
	// find it to give the charge back.
	c.rwin.release(c.s.cfg.Budget)
	sock := d.socket()
	c.mu.Unlock()
	if shut {
		// The peer reads no more: a writer blocked on the socket returns.
		closeSocketWrite(sock)
	}
	runHook(hook)
	c.wake()
	c.s.purge(c)
	c.s.finish(c)
}

// onSessionEnd fails c because its session ended with err.
func (c *Conn) onSessionEnd(err error) {
	c.mu.Lock()
	hook := c.endLocked(c.life.broke(), ConnSessionEnded, err)
	if c.rstate == recvOpen {
		c.rstate, c.rerr = recvFailed, err
	}
	c.failSendLocked(err)
	c.rwin.release(c.s.cfg.Budget)
	sock := c.direct.Load().socket()
	c.mu.Unlock()
	closeSocket(sock, true, false, nil)
	runHook(hook)
	c.wake()
}

// peerErrLocked is the peer's abort when that is what broke c, else nil.
func (c *Conn) peerErrLocked() error {
	if pe, ok := c.endErr.(*PeerError); ok && (c.endHow == ConnPeerAborted || c.endHow == ConnRefused) {
		return pe
	}
	return nil
}

func (c *Conn) peerErrOrNil() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.peerErrLocked()
}

// whenBroken registers f to run once c breaks: it is aborted by either
// end, or its session ends. A relay uses it to close the real connection
// on the other side, whose read may otherwise wait forever (an upstream
// that ignores a half-close). f runs at once if c is broken already; nil
// unregisters. f runs on a goroutine of its own: closing a TLS connection
// may block on its close_notify, and the caller may be the receive loop.
func (c *Conn) whenBroken(f func()) {
	c.mu.Lock()
	if c.life.broken() && f != nil {
		c.mu.Unlock()
		runHook(f)
		return
	}
	c.brokenHook = f
	c.mu.Unlock()
}

func (c *Conn) isBroken() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.life.broken()
}

// brokenErr is why c broke: its write error, else its read error.
func (c *Conn) brokenErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.werr != nil {
		return c.werr
	}
	return c.rerr
}

func runHook(f func()) {
	if f != nil {
		go f()
	}
}

// awaitSent waits, at most d, until every frame c queued has left the
// sender (or c broke, which drops them) and, once its writes moved to a
// direct socket, until the peer acknowledged every byte written there: an
// abort resets the socket, which drops what is not.
func (c *Conn) awaitSent(d time.Duration) {
	deadline := time.Now().Add(d)
	unacked := func() int { return 0 }
	if ds := c.direct.Load(); ds.writeMoved() {
		if q := sendQueue(ds.socket()); q != nil {
			unacked = q
		}
	}
	for (c.queued.Load() > 0 || unacked() > 0) && !c.isBroken() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // an error path's bounded wait: polling is enough
	}
}

// Counts returns the payload bytes read from and written to the
// connection so far. It is cheap enough to poll, which is how a relay can
// watch for idleness without wrapping the connection (and losing its
// ReadFrom/WriteTo fast paths).
func (c *Conn) Counts() (read, written int64) {
	return c.bytesRead.Load(), c.bytesWritten.Load()
}

// Buffered returns the bytes received and not yet read.
func (c *Conn) Buffered() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int(c.buffered)
}

// LocalAddr implements net.Conn.
func (c *Conn) LocalAddr() net.Addr { return Addr{ID: c.id, Side: "local", Route: c.info.RouteKey} }

// RemoteAddr implements net.Conn: the public client's address when the
// opener announced one.
func (c *Conn) RemoteAddr() net.Addr {
	if c.flow != nil && c.info.RemoteAddr != "" {
		if a, err := net.ResolveUDPAddr("udp", c.info.RemoteAddr); err == nil {
			return a
		}
	}
	if a, err := net.ResolveTCPAddr("tcp", c.info.RemoteAddr); err == nil && c.info.RemoteAddr != "" {
		return a
	}
	return Addr{ID: c.id, Side: "remote", Route: c.info.RouteKey}
}

// SetDeadline implements net.Conn.
func (c *Conn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

// SetReadDeadline implements net.Conn.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.rdl.set(t)
	c.mu.Lock()
	defer c.mu.Unlock()
	// Under mu, and not once closed: the socket's deadlines are then the
	// close's (closeSocket, linger). A socket attached later takes the
	// deadline from rdl.
	if sock := c.direct.Load().socket(); sock != nil && !c.life.closed() {
		sock.SetReadDeadline(t)
	}
	return nil
}

// SetWriteDeadline implements net.Conn.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.wdl.set(t)
	c.mu.Lock()
	defer c.mu.Unlock()
	if sock := c.direct.Load().socket(); sock != nil && !c.life.closed() {
		sock.SetWriteDeadline(t)
	}
	return nil
}

// Addr is the net.Addr of a virtual connection.
type Addr struct {
	ID    uint64
	Side  string
	Route string
}

// Network implements net.Addr.
func (Addr) Network() string { return "sluice" }

func (a Addr) String() string {
	if a.Route != "" {
		return a.Route + "#" + itoa(a.ID)
	}
	return "conn#" + itoa(a.ID)
}

func errorFrame(id uint64, code tunnelpb.Error_Code, msg string) *tunnelpb.Frame {
	return &tunnelpb.Frame{Kind: &tunnelpb.Frame_Error{Error: &tunnelpb.Error{ConnId: id, Code: code, Message: errorMessage(msg)}}}
}

// maxErrorMessage bounds the text of an Error frame.
const maxErrorMessage = 512

// errorMessage makes msg fit an Error frame: at most maxErrorMessage bytes,
// cut at a rune boundary, and valid UTF-8, which a protobuf string must be
// (a reason quoting bytes from a peer or an upstream need not be; an
// invalid one would fail the marshalling of the frame, and the session).
func errorMessage(msg string) string {
	msg = strings.ToValidUTF8(msg, "\uFFFD")
	if len(msg) <= maxErrorMessage {
		return msg
	}
	cut := maxErrorMessage
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut]
}
