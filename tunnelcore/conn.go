package tunnelcore

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"go.uber.org/zap"
	"google.golang.org/grpc/mem"

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

// Conn is one virtual connection of a Session. It is a net.Conn with
// half-close (CloseWrite) and deadlines; Read and Write may be called
// concurrently with each other, as on a TCP connection.
//
// Writes are sent only against the credit the peer granted, so a peer that
// stops reading holds back this connection alone. Reads never block the
// session: what arrives is buffered within the window this end granted.
type Conn struct {
	s    *Session
	id   uint64
	info ConnectInfo

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
	// handed to the sender (Counts).
	bytesRead, bytesWritten atomic.Int64

	mu sync.Mutex
	// receive direction
	rq       fifo[mem.Buffer]
	open     *[]byte // small payloads gathered after rq's last buffer (see smallPayload)
	openLen  int     // bytes of open in use
	buffered int64   // bytes received and not yet consumed (including those WriteTo holds)
	taken    int64   // bytes WriteTo took out of rq, still counted in buffered
	batch    int     // SetWriteToBatch; 0: writeToBatch
	rwin     recvWindow
	readEOF  bool  // the peer half-closed its direction
	rerr     error // the reason reads fail once the buffer is empty
	// send direction
	credit      int64
	blockedSent bool   // told the peer we ran out of credit since its last grant
	wclosed     bool   // CloseWrite or Close queued our FIN
	werr        error  // the reason writes fail
	closed      bool   // Close was called
	aborted     bool   // ended by an error this end raised
	broken      bool   // ended by an abort (either end) or the session's end
	brokenHook  func() // run once when broken (whenBroken)

	slot        bool         // holds a Slots slot
	slotState   atomic.Int32 // slotHeld, slotClosing or slotReleased
	lastConsume time.Time    // when the reader last took bytes (under mu)
	reclaiming  bool         // a reclaim request is outstanding (under mu)
	reclaimed   bool         // reclaimed since the reader last took bytes: do not ask again (under mu)

	// direct socket (direct.go)
	directState atomic.Int32  // directNone, directDialing, directOn, directFailed
	wlock       chan struct{} // held by Write and ReadFrom (lockWrites): one writer moves the direction
	sock        net.Conn      // the direct socket, once attached (under mu)
	wmoved      bool          // this end's writes go to sock (under mu)
	wshut       bool          // CloseWrite half-closed sock (under mu)
	rmoved      bool          // the peer's writes come on sock after the buffered bytes (under mu)
	peerErr     error         // the peer's abort, for errors the socket reports after it (under mu)
	sockEOF     bool          // the reader read the socket's EOF (under mu)
	windowGone  bool          // the receive window's charge went back after the move (under mu)
	closedFlag  atomic.Bool   // Close or an abort ran (a socket read drops what it got after)
	ended       chan struct{} // closed once c ends (markEnded)
	endOnce     sync.Once
	sockReaders atomic.Int32  // readers in a read of the direct socket (enterSocketRead)
	readersGone chan struct{} // closed once none is left after Close (socketReadersGone)
	readersOnce sync.Once
	rdlAt       time.Time // the read deadline, for a socket attached later (under mu)
	wdlAt       time.Time // the write deadline, likewise (under mu)

	// sender state, guarded by the sender's mutex
	sq             fifo[*tunnelpb.Envelope]
	inReady        bool
	finished       bool // no more frames will be queued; remove once sq drains
	removed        bool
	dataDone       bool  // our FIN or abort went to the sender: DATA is refused
	answersOwed    int64 // reclaim requests not answered yet
	answerReleased int64 // credit given back, not reported in an answer yet
	answerQueued   bool  // the control queue holds this connection's answers
	grantOwed      int64 // credit decided for the peer, not sent yet
	grantQueued    bool  // the control queue holds this connection's grant
	ctrlHeld       int   // control queue entries of this connection
}

func newConn(s *Session, id uint64, info ConnectInfo, credit int64) *Conn {
	return &Conn{
		s:           s,
		id:          id,
		info:        info,
		readNotify:  make(chan struct{}, 1),
		writeNotify: make(chan struct{}, 1),
		wlock:       make(chan struct{}, 1),
		ended:       make(chan struct{}),
		readersGone: make(chan struct{}),
		rdl:         makeDeadline(),
		wdl:         makeDeadline(),
		rwin:        newRecvWindow(InitialWindow),
		credit:      credit,
		lastConsume: time.Now(),
	}
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

// shouldReclaim reports whether c's reader has been idle long enough with a
// grown window, and marks the reclaim as sent.
func (c *Conn) shouldReclaim(now time.Time, after time.Duration) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.reclaiming || c.reclaimed || c.rwin.size <= InitialWindow || c.rerr != nil || c.readEOF || c.rmoved || now.Sub(c.lastConsume) < after {
		return false
	}
	c.reclaiming = true
	return true
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

// Read implements net.Conn. After the peer's CloseWrite it returns the
// buffered bytes, then io.EOF.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if isClosedChan(c.rdl.wait()) {
			return 0, timeoutError{}
		}
		c.mu.Lock()
		if c.hasBufferedLocked() {
			n := c.copyOutLocked(p)
			inc := c.consumeLocked(int64(n))
			c.mu.Unlock()
			c.grant(inc)
			return n, nil
		}
		if c.rmoved && c.rerr == nil {
			c.mu.Unlock()
			return c.readDirect(p)
		}
		if err := c.readStateLocked(); err != nil {
			c.mu.Unlock()
			notify(c.readNotify) // the next waiting reader ends too
			return 0, err
		}
		c.rwin.readerWaited = true
		c.mu.Unlock()
		if err := c.waitRead(); err != nil {
			return 0, err
		}
	}
}

// readStateLocked returns io.EOF or the read error once nothing is buffered.
func (c *Conn) readStateLocked() error {
	if c.readEOF {
		return io.EOF
	}
	return c.rerr
}

func (c *Conn) waitRead() error {
	select {
	case <-c.readNotify:
		return nil
	case <-c.rdl.wait():
		return timeoutError{}
	case <-c.s.done:
		// The session's end fails its connections; record it here too, in
		// case c never reached the table the session failed, so that the
		// re-check finds an error instead of waiting again at once.
		c.onSessionEnd(c.s.err)
		return nil
	}
}

// copyOutLocked copies buffered bytes into p, freeing drained buffers.
func (c *Conn) copyOutLocked(p []byte) int {
	n := 0
	for n < len(p) && c.nextBufferLocked() {
		b := c.rq.items[c.rq.head]
		data := b.ReadOnlyData()
		m := copy(p[n:], data)
		n += m
		if m == len(data) {
			c.rq.pop().Free()
		} else {
			c.rq.items[c.rq.head] = b.Slice(m, len(data))
			b.Free()
		}
	}
	return n
}

// consumeLocked accounts bytes the reader took and returns the credit to grant.
func (c *Conn) consumeLocked(n int64) int64 {
	c.buffered -= n
	c.s.buffered.Add(-n)
	return c.tookLocked(n)
}

// consumeTakenLocked is consumeLocked for n bytes WriteTo took out of rq.
// Close or an abort may have dropped the buffer meanwhile, and taken these
// bytes off the buffered counts with it: they are not taken off twice.
func (c *Conn) consumeTakenLocked(n int64) int64 {
	counted := min(n, c.taken)
	c.taken -= counted
	c.buffered -= counted
	c.s.buffered.Add(-counted)
	return c.tookLocked(n)
}

// tookLocked accounts n bytes the reader took, already off the buffered
// counts, and returns the credit to grant.
func (c *Conn) tookLocked(n int64) int64 {
	c.countMoved(false, n)
	c.lastConsume = time.Now()
	c.reclaimed = false
	if c.rerr != nil || c.readEOF || c.rmoved {
		return 0
	}
	return c.rwin.consume(n, c.s.cfg.Budget, int64(c.s.cfg.MaxWindow))
}

func (c *Conn) grant(inc int64) {
	if inc <= 0 {
		return
	}
	c.s.sendGrant(c, inc)
}

// WriteTo implements io.WriterTo: it writes received buffers to w without
// copying them first, until EOF or an error.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		bufs, err := c.takeBuffered()
		if err == errReadMoved {
			n, err := c.writeDirectTo(w)
			return total + n, err
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		taken := int64(mem.BufferSlice(bufs).Len())
		n, werr := writeBuffers(w, bufs)
		total += n
		for i, b := range bufs {
			b.Free()
			bufs[i] = nil
		}
		// What the writer failed to take is dropped with its buffers: it is
		// consumed either way.
		c.mu.Lock()
		inc := c.consumeTakenLocked(taken)
		c.mu.Unlock()
		c.grant(inc)
		if werr != nil {
			return total, werr
		}
	}
}

// coalesceLimit bounds the copy writeBuffers makes to turn many small
// buffers into one write.
const coalesceLimit = 256 << 10

// writeBuffers writes bufs to w with as few writes as it can. Received
// data arrives in gRPC's 16 KiB frame buffers: a TCP connection takes them
// in one writev; any other writer gets them copied into writes of up to
// 256 KiB, since a copy costs far less than a write per 16 KiB.
func writeBuffers(w io.Writer, bufs []mem.Buffer) (int64, error) {
	if len(bufs) == 1 {
		return writeFull(w, bufs[0].ReadOnlyData())
	}
	if tc, ok := w.(*net.TCPConn); ok {
		nb := make(net.Buffers, len(bufs))
		for i, b := range bufs {
			nb[i] = b.ReadOnlyData()
		}
		return nb.WriteTo(tc)
	}
	var total int64
	scratch := bufferPool.Get(coalesceLimit)
	defer bufferPool.Put(scratch)
	chunk := (*scratch)[:0]
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		n, err := writeFull(w, chunk)
		total += n
		chunk = chunk[:0]
		return err
	}
	for _, b := range bufs {
		data := b.ReadOnlyData()
		if len(data) >= coalesceLimit/2 {
			if err := flush(); err != nil {
				return total, err
			}
			n, err := writeFull(w, data)
			total += n
			if err != nil {
				return total, err
			}
			continue
		}
		if len(chunk)+len(data) > coalesceLimit {
			if err := flush(); err != nil {
				return total, err
			}
		}
		chunk = append(chunk, data...)
	}
	return total, flush()
}

func writeFull(w io.Writer, p []byte) (int64, error) {
	n, err := w.Write(p)
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	return int64(n), err
}

// takeBuffered waits for data and removes every buffered buffer, leaving the
// bytes counted as buffered until the caller consumes them.
func (c *Conn) takeBuffered() ([]mem.Buffer, error) {
	for {
		if isClosedChan(c.rdl.wait()) {
			return nil, timeoutError{}
		}
		c.mu.Lock()
		if c.hasBufferedLocked() {
			bufs := c.takeBatchLocked()
			c.mu.Unlock()
			return bufs, nil
		}
		if c.rmoved && c.rerr == nil {
			c.mu.Unlock()
			return nil, errReadMoved
		}
		if err := c.readStateLocked(); err != nil {
			c.mu.Unlock()
			notify(c.readNotify) // the next waiting reader ends too
			return nil, err
		}
		c.rwin.readerWaited = true
		c.mu.Unlock()
		if err := c.waitRead(); err != nil {
			return nil, err
		}
	}
}

// writeToBatch bounds what one WriteTo write takes: the credit for a batch
// goes back to the peer (and the bytes count as moved, Counts) only once
// the batch is written, so with a window of several MiB and a slow writer a
// whole window would otherwise wait on one write.
const writeToBatch = 256 << 10

// SetWriteToBatch bounds what one write of WriteTo takes (default 256 KiB,
// at least one received buffer, 16 KiB from gRPC). Counts advances as each
// write completes, so a caller that watches Counts for idleness sets it
// small: a slow but steady reader then shows progress within its timeout,
// at the cost of more writes.
func (c *Conn) SetWriteToBatch(n int) {
	c.mu.Lock()
	c.batch = max(n, 1)
	c.mu.Unlock()
}

// takeBatchLocked removes buffered buffers from the front, up to about
// the write batch (at least one buffer).
func (c *Conn) takeBatchLocked() []mem.Buffer {
	var bufs []mem.Buffer
	size := 0
	limit := c.batch
	if limit == 0 {
		limit = writeToBatch
	}
	for c.nextBufferLocked() && (len(bufs) == 0 || size+c.rq.items[c.rq.head].Len() <= limit) {
		b := c.rq.pop()
		size += b.Len()
		bufs = append(bufs, b)
	}
	c.taken += int64(size)
	return bufs
}

// Write implements net.Conn. It returns once p is queued for the sender,
// waiting for credit from the peer and room in the queue as needed.
func (c *Conn) Write(p []byte) (int, error) {
	if err := c.lockWrites(); err != nil {
		return 0, err
	}
	defer c.unlockWrites()
	total := 0
	pool := bufferPool
	for len(p) > 0 {
		sock, err := c.writeSocket()
		if err != nil {
			return total, err
		}
		if sock != nil {
			n, err := c.writeDirect(sock, p)
			return total + n, err
		}
		n, err := c.reserve(len(p))
		if err == errGoDirect {
			continue
		}
		if err != nil {
			return total, err
		}
		buf := pool.Get(n)
		copy(*buf, p[:n])
		if err := c.s.sendData(c, mem.NewBuffer(buf, pool)); err != nil {
			return total, err
		}
		p = p[n:]
		total += n
	}
	return total, nil
}

// ReadFrom implements io.ReaderFrom: it reads from r straight into the
// buffers it hands to the sender, sending no more than the peer's credit.
// From a TCP socket onto a plaintext lane, a connection whose reads show
// bulk moves its payloads inside the kernel instead (see splice.go).
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	if err := c.lockWrites(); err != nil {
		return 0, err
	}
	defer c.unlockWrites()
	var src syscall.RawConn
	if c.s.sender.splice != nil {
		src = spliceSource(r)
	}
	var total int64
	bulk := false
	for {
		sock, err := c.writeSocket()
		if err != nil {
			return total, err
		}
		if sock != nil {
			n, err := c.readFromDirect(sock, r)
			return total + n, err
		}
		if bulk {
			n, err := c.spliceFrom(src)
			total += n
			switch {
			case err == io.EOF:
				return total, nil
			case err == errGoDirect:
				continue
			case err != errSpliceOff:
				return total, err
			}
			// Copy until the next bulk read: past the urgent byte, or
			// until a pipe is to be had.
		}
		m, err := c.readFrame(r)
		total += int64(m)
		if err == errGoDirect {
			continue
		}
		if err != nil {
			if err == io.EOF {
				return total, nil
			}
			return total, err
		}
		bulk = src != nil && m >= spliceAbove
	}
}

// readFrame reads one frame's worth from r into a buffer and queues it,
// returning its length; io.EOF at r's end.
func (c *Conn) readFrame(r io.Reader) (int, error) {
	n, err := c.reserve(c.s.cfg.MaxFrameSize)
	if err != nil {
		return 0, err
	}
	pool := bufferPool
	buf := pool.Get(n)
	m, rerr := r.Read(*buf)
	if m < n {
		c.unreserve(int64(n), int64(m))
	}
	if m > 0 {
		buf = fitBuffer(buf, m)
		if err := c.s.sendData(c, mem.NewBuffer(buf, pool)); err != nil {
			return 0, err
		}
	} else {
		pool.Put(buf)
	}
	return m, rerr
}

// spliceFrom is ReadFrom's loop for a bulk connection from a TCP socket:
// each frame's payload goes through a pipe, which the sender drains into
// the lane in the connection's turn. It returns io.EOF at the socket's
// end and errSpliceOff when the connection is to go on copying.
func (c *Conn) spliceFrom(src syscall.RawConn) (total int64, err error) {
	f := &splicedFrame{done: make(chan error, 1)}
	for {
		n, err := c.reserve(min(c.s.cfg.MaxFrameSize, pipeSize))
		if err != nil {
			return total, err
		}
		p, m, err := fillPipe(src, n)
		if m < n {
			c.unreserve(int64(n), int64(m))
		}
		if err != nil {
			return total, err
		}
		f.pipe, f.n = p, m
		if !c.s.sendSpliced(c, f) {
			pipes.put(p, false)
			return total, c.dataRefused(int64(m))
		}
		if err := <-f.done; err != nil {
			pipes.put(p, false) // it may still hold the payload
			return total, c.dataRefused(int64(m))
		}
		pipes.put(p, true)
		c.countMoved(true, int64(m))
		c.s.spliced.Add(int64(m))
		total += int64(m)
	}
}

// reserve waits until the connection may queue up to want bytes and
// charges them against the credit and the queue.
func (c *Conn) reserve(want int) (int, error) {
	for {
		if isClosedChan(c.wdl.wait()) {
			return 0, timeoutError{}
		}
		c.mu.Lock()
		if c.sock != nil && c.werr == nil && !c.wshut && (c.wmoved || !c.wclosed) {
			c.mu.Unlock()
			return 0, errGoDirect
		}
		if c.werr != nil || c.wclosed {
			err := c.werr
			if err == nil {
				err = ErrWriteClosed
			}
			c.mu.Unlock()
			// One wake-up ends every writer waiting here: a notice holds
			// a single token, and net.Conn allows concurrent Writes.
			notify(c.writeNotify)
			return 0, err
		}
		if room := int64(c.s.cfg.SendQueue) - c.queued.Load(); c.credit > 0 && room > 0 {
			// Never past SendQueue by more than one frame's minimum
			// charge: the sender only lowers queued, so the room
			// measured here is there, and the frame is cut to what its
			// buffer's charge fits in.
			n := int64(min(want, c.s.cfg.MaxFrameSize))
			n = fitRoom(min(n, c.credit, room), room)
			c.credit -= n
			c.queued.Add(frameCharge(n))
			c.mu.Unlock()
			return int(n), nil
		}
		tellBlocked := c.credit == 0 && !c.blockedSent
		if tellBlocked {
			c.blockedSent = true
		}
		c.mu.Unlock()
		if tellBlocked {
			c.s.sendConnControl(c, &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
				WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.id, Blocked: true},
			}})
		}
		select {
		case <-c.writeNotify:
		case <-c.wdl.wait():
			return 0, timeoutError{}
		case <-c.s.done:
			c.mu.Lock()
			err := c.werr
			c.mu.Unlock()
			if err == nil {
				err = c.s.Err()
			}
			return 0, err
		}
	}
}

// unreserve gives back what a reservation of reserved bytes did not use.
func (c *Conn) unreserve(reserved, used int64) {
	c.mu.Lock()
	c.credit += reserved - used
	c.mu.Unlock()
	c.queued.Add(frameCharge(used) - frameCharge(reserved))
}

// dataRefused gives back the credit of n reserved bytes the sender refused
// (their queue allowance went back with the frame) and returns why the
// write side ended.
func (c *Conn) dataRefused(n int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.credit += n
	switch {
	case c.werr != nil:
		return c.werr
	case c.wclosed:
		return ErrWriteClosed
	}
	if err := c.s.Err(); err != nil {
		return err
	}
	return ErrConnClosed
}

// CloseWrite half-closes the connection: the peer reads EOF after the bytes
// already written, and may still send.
func (c *Conn) CloseWrite() error {
	c.mu.Lock()
	if c.wmoved && c.werr == nil {
		if c.wshut {
			c.mu.Unlock()
			return nil
		}
		c.wshut = true
		sock := c.sock
		c.mu.Unlock()
		notify(c.writeNotify)
		if err := closeSocketWrite(sock); err != nil {
			// The socket failed under it (the peer reset it): the peer's
			// word if it came, else the socket's.
			if pe := c.peerErrOrNil(); pe != nil {
				return pe
			}
			return fmt.Errorf("direct socket: %w", err)
		}
		return nil
	}
	if c.werr != nil && !c.wclosed {
		err := c.werr
		c.mu.Unlock()
		return err
	}
	if c.wclosed {
		c.mu.Unlock()
		return nil
	}
	c.wclosed = true
	c.mu.Unlock()
	notify(c.writeNotify)
	c.s.sendFIN(c)
	return nil
}

// Close implements net.Conn: bytes already written are still delivered,
// followed by EOF; if the peer was still sending, it is told to stop.
func (c *Conn) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.closedFlag.Store(true)
	sendFIN := !c.wclosed && c.werr == nil
	c.wclosed = true
	cancelPeer := !c.readEOF && !c.sockEOF && c.rerr == nil && c.werr == nil
	peerDone := c.readEOF || c.sockEOF
	if c.werr == nil {
		c.werr = ErrConnClosed
	}
	if c.rerr == nil {
		c.rerr = ErrConnClosed
	}
	c.readEOF = false // reads fail with ErrConnClosed from now on
	c.dropBufferedLocked()
	c.rwin.release(c.s.cfg.Budget)
	sock := c.sock
	if sock != nil {
		// A reader blocked on the socket returns now (its error is set);
		// under mu, so that no SetReadDeadline undoes it.
		sock.SetReadDeadline(time.Now())
	}
	c.mu.Unlock()
	c.markEnded()
	closeSocket(sock, false, peerDone, c.socketReadersGone())

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
	if c.aborted {
		c.mu.Unlock()
		return
	}
	c.aborted = true
	c.setErrorsLocked(err)
	c.closed = true
	c.closedFlag.Store(true)
	// Reads fail from now on, also after the peer's FIN: what it sent is
	// dropped, and a clean EOF would pass the loss off as the whole stream.
	c.readEOF = false
	c.dropBufferedLocked()
	hook := c.breakLocked()
	sock := c.sock
	c.mu.Unlock()
	c.markEnded()
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

// setErrorsLocked records err for both directions unless they ended already.
func (c *Conn) setErrorsLocked(err error) {
	if c.rerr == nil {
		c.rerr = err
	}
	if c.werr == nil || c.werr == ErrConnClosed {
		c.werr = err
	}
	c.wclosed = true
	c.rwin.release(c.s.cfg.Budget)
}

func (c *Conn) wake() {
	notify(c.readNotify)
	notify(c.writeNotify)
}

// onData is called by the receive loop with a DATA payload for c.
func (c *Conn) onData(payload mem.BufferSlice) {
	n := int64(payload.Len())
	c.mu.Lock()
	if c.closed || c.rerr != nil {
		// Read side gone: drop, the peer was or will be told.
		c.mu.Unlock()
		payload.Free()
		return
	}
	if c.readEOF || c.rmoved {
		c.mu.Unlock()
		payload.Free()
		if ok, suppressed := c.s.peerLog.Allow(); ok {
			c.s.cfg.Logger.Warn("tunnel peer sent data after closing its direction; connection failed",
				zapConn(c.id), zap.Int("suppressed", suppressed))
		}
		c.fail(&PeerError{Code: tunnelpb.Error_PROTOCOL, Message: "data after close"}, tunnelpb.Error_PROTOCOL, "data after close")
		return
	}
	if !c.rwin.receive(n) {
		c.mu.Unlock()
		payload.Free()
		c.s.logFlowViolation(c.id)
		c.fail(ErrFlowControl, tunnelpb.Error_FLOW_CONTROL, "data beyond granted credit")
		return
	}
	c.bufferLocked(payload, n)
	c.buffered += n
	c.s.buffered.Add(n)
	c.mu.Unlock()
	notify(c.readNotify)
}

// onPeerClose is called when the peer half-closed its direction.
func (c *Conn) onPeerClose() {
	c.mu.Lock()
	if c.rerr == nil {
		c.readEOF = true
	}
	c.mu.Unlock()
	notify(c.readNotify)
}

// onPeerError is called when the peer aborted the connection.
func (c *Conn) onPeerError(e *tunnelpb.Error) {
	perr := &PeerError{Code: e.GetCode(), Message: e.GetMessage()}
	c.mu.Lock()
	c.peerErr = perr
	// A direction on the direct socket ends as the socket tells: the
	// peer's FIN after its last bytes (its Close), or a reset (its abort).
	if c.rerr == nil && !c.readEOF && !c.rmoved {
		c.rerr = perr
	}
	shut := c.wmoved && !c.wshut && !c.closed
	if c.werr == nil || c.werr == ErrConnClosed {
		if !c.closed {
			c.werr = perr
		}
	}
	c.wclosed = true
	// The window grows no more (nothing is granted once rerr is set), and
	// c leaves the session's table now: a later session end would not
	// find it to give the charge back.
	c.rwin.release(c.s.cfg.Budget)
	hook := c.breakLocked()
	sock := c.sock
	c.mu.Unlock()
	c.markEnded()
	if shut {
		// The peer reads no more: a writer blocked on the socket returns.
		closeSocketWrite(sock)
	}
	runHook(hook)
	c.wake()
	c.s.purge(c)
	c.s.finish(c)
}

// onWindowUpdate is called with the peer's flow control for c.
func (c *Conn) onWindowUpdate(u *tunnelpb.WindowUpdate) {
	var released, topUp int64
	c.mu.Lock()
	if u.GetBlocked() {
		c.rwin.peerBlocked = true
	}
	if inc := int64(u.GetIncrement()); inc > 0 {
		c.credit += inc
		c.blockedSent = false
	}
	above := int64(u.GetReclaimAbove())
	if above > 0 && c.credit > above {
		// The peer's reader is idle: give back the credit above what it
		// keeps, so it can release its budget.
		released = c.credit - above
		c.credit = above
	}
	if u.GetReleased() > 0 || (u.GetReclaimAbove() == 0 && u.GetIncrement() == 0 && !u.GetBlocked() && c.reclaiming) {
		c.rwin.reclaimed(int64(u.GetReleased()), c.s.cfg.Budget)
		c.reclaiming = false
		c.reclaimed = true
		if c.rerr == nil && !c.readEOF && !c.rmoved {
			topUp = c.rwin.topUp()
		}
	}
	c.mu.Unlock()
	c.grant(topUp)
	if u.GetIncrement() > 0 {
		notify(c.writeNotify)
	}
	if above > 0 {
		c.s.sendReclaimAnswer(c, released)
	}
}

// onSessionEnd fails c because its session ended with err.
func (c *Conn) onSessionEnd(err error) {
	c.mu.Lock()
	if c.rerr == nil && !c.readEOF {
		c.rerr = err
	}
	if c.werr == nil {
		c.werr = err
	}
	c.rwin.release(c.s.cfg.Budget)
	hook := c.breakLocked()
	sock := c.sock
	c.mu.Unlock()
	c.markEnded()
	closeSocket(sock, true, false, nil)
	runHook(hook)
	c.wake()
}

// whenBroken registers f to run once c breaks: it is aborted by either
// end, or its session ends. A relay uses it to close the real connection
// on the other side, whose read may otherwise wait forever (an upstream
// that ignores a half-close). f runs at once if c is broken already; nil
// unregisters. f runs on a goroutine of its own: closing a TLS connection
// may block on its close_notify, and the caller may be the receive loop.
func (c *Conn) whenBroken(f func()) {
	c.mu.Lock()
	if c.broken && f != nil {
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
	return c.broken
}

// breakLocked marks c broken and returns the hook to run, once.
func (c *Conn) breakLocked() func() {
	if c.broken {
		return nil
	}
	c.broken = true
	f := c.brokenHook
	c.brokenHook = nil
	return f
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
	c.mu.Lock()
	unacked := func() int { return 0 }
	if c.wmoved {
		if q := sendQueue(c.sock); q != nil {
			unacked = q
		}
	}
	c.mu.Unlock()
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
	c.rdlAt = t
	// Under mu, and not once closed: the socket's deadlines are then the
	// close's (closeSocket, linger).
	if c.sock != nil && !c.closed {
		c.sock.SetReadDeadline(t)
	}
	return nil
}

// SetWriteDeadline implements net.Conn.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.wdl.set(t)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wdlAt = t
	if c.sock != nil && !c.closed {
		c.sock.SetWriteDeadline(t)
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
