package tunnelcore

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// movedPair returns a connection whose both directions moved to the
// direct socket, with the first bytes of each read.
func movedPair(t *testing.T) (nc, ac *Conn) {
	t.Helper()
	return movedPairWith(t, directOpts{})
}

// attachedPair returns a connection whose ends both have their direct
// socket (the agent's first byte read; only its direction moved).
func attachedPair(t *testing.T, tune ...func(*net.TCPConn)) (nc, ac *Conn) {
	t.Helper()
	node, agent := directPair(t, transport{"lane", lanePair}, 1, tune...)
	nc, ac = openAccepted(t, node, agent)
	if _, err := ac.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	if _, err := io.ReadFull(nc, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	return nc, ac
}

// movedPairWith is movedPair with opts (TLS: tlsDirect).
func movedPairWith(t *testing.T, opts directOpts) (nc, ac *Conn) {
	t.Helper()
	node, agent := directPairWith(t, transport{"lane", lanePair}, 1, opts)
	nc, ac = openAccepted(t, node, agent)
	if _, err := ac.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	// Writes after the attach move each direction.
	if _, err := ac.Write([]byte("b")); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Write([]byte("c")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(nc, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(ac, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	ok := nc.direct.Load().readMoved() && nc.direct.Load().writeMoved()
	ok = ok && ac.direct.Load().readMoved() && ac.direct.Load().writeMoved()
	if !ok {
		t.Fatal("not both directions moved")
	}
	return nc, ac
}

// The peer's abort of a moved connection: the reader of the moved
// direction must report the peer's RESET (proto/README §2.5).
func TestDirectPeerAbortOnAMovedDirection(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts func(t *testing.T) directOpts
	}{
		{"plaintext", func(*testing.T) directOpts { return directOpts{} }},
		// Under TLS a close_notify would read as a clean EOF.
		{"tls", tlsDirect},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nc, ac := movedPairWith(t, tc.opts(t))
			defer nc.Close()
			done := make(chan error, 1)
			go func() { _, err := nc.Read(make([]byte, 10)); done <- err }()
			ac.Abort(tunnelpb.Error_RESET, "upstream cut the response short")
			select {
			case err := <-done:
				var pe *PeerError
				if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_RESET {
					t.Fatalf("read after the peer's abort = %v; want its RESET", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("read hung")
			}
		})
	}
}

// Close must unblock a Read blocked on the moved direction's socket at
// once, with ErrConnClosed, and no bytes after the Close may reach it.
func TestDirectCloseUnblocksASocketRead(t *testing.T) {
	for i := range 20 {
		nc, ac := movedPair(t)
		done := make(chan error, 1)
		go func() {
			n, err := nc.Read(make([]byte, 10))
			if n > 0 {
				err = errors.New("read returned bytes written after Close")
			}
			done <- err
		}()
		start := time.Now()
		nc.Close()
		// The peer keeps writing a little after the Close.
		go func() {
			for range 5 {
				ac.Write([]byte("late"))
			}
		}()
		select {
		case err := <-done:
			if !errors.Is(err, ErrConnClosed) || time.Since(start) > 500*time.Millisecond {
				t.Fatalf("round %d: read blocked across Close returned %v after %v; want ErrConnClosed at once", i, err, time.Since(start))
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: read hung after Close", i)
		}
		ac.Close()
	}
}

// A Write waiting for the write lock (another goroutine's ReadFrom waits
// on an idle source) must return once the connection is closed, as a TCP
// socket's does. No direct socket involved: plain lane connections.
func TestCloseEndsAWriteWaitingForTheWriteLock(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	nc, ac := openAccepted(t, node, agent)
	defer ac.Close()
	src, srcW := io.Pipe()
	defer srcW.Close()
	go nc.ReadFrom(src) // waits on src
	eventually(t, 5*time.Second, "ReadFrom holding the write lock", func() bool { return len(nc.wlock) == 1 })
	done := make(chan error, 1)
	go func() { _, err := nc.Write([]byte("x")); done <- err }()
	nc.Close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("write after Close succeeded")
		}
	case <-time.After(3 * time.Second):
		srcW.Close()
		<-done
		t.Fatal("Write stayed blocked after Close (until ReadFrom's source returned)")
	}
}

// attachBoth gives nc/ac a direct socket by hand (no dial).
func attachBoth(t *testing.T, node *Session, nc, ac *Conn) {
	t.Helper()
	a, b := tcpPair(t)
	if err := node.AttachDirect(nc.ID(), a); err != nil {
		t.Fatal(err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(b, answer[:]); err != nil {
		t.Fatal(err)
	}
	ac.direct.Store(newDirectSocket(directDialing)) // as a dial under way
	if err := ac.attach(b, false); err != nil {
		t.Fatal(err)
	}
}

// A Write that moves the direction racing Close: the peer, which had
// half-closed already, must still read EOF (the Close{moved} marker must
// not be dropped after the connection left the sender).
func TestDirectCloseRacingTheMove(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1<<40)
	for i := range 500 {
		nc, ac := openAccepted(t, node, agent)
		attachBoth(t, node, nc, ac)
		ac.CloseWrite()
		eventually(t, 5*time.Second, "the node read the agent's FIN", func() bool {
			nc.mu.Lock()
			defer nc.mu.Unlock()
			return nc.rstate == recvEOF
		})
		started := make(chan struct{})
		go func() { close(started); nc.Write([]byte("data")) }()
		<-started
		for end := time.Now().Add(time.Duration(i%40) * time.Microsecond); time.Now().Before(end); {
		}
		nc.Close()
		ac.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, err := io.ReadAll(ac)
		if err != nil {
			rm := ac.direct.Load().readMoved()
			ac.mu.Lock()
			eof, rerr := ac.rstate == recvEOF, ac.rerr
			ac.mu.Unlock()
			node.sender.mu.Lock()
			removed := nc.removed
			node.sender.mu.Unlock()
			t.Fatalf("round %d: the peer's read after a Write racing Close: %v (peer rmoved %v readEOF %v rerr %v; node conn removed %v wmoved %v)", i, err, rm, eof, rerr, removed, nc.direct.Load().writeMoved())
		}
		ac.Close()
	}
}

// Write after CloseWrite on a moved direction: ErrWriteClosed, as on the
// lane (the relay tells errors apart by it: an EPIPE reads as a peer reset).
func TestDirectWriteAfterCloseWrite(t *testing.T) {
	nc, ac := movedPair(t)
	defer nc.Close()
	defer ac.Close()
	if err := nc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_, err := nc.Write([]byte("x"))
	if !errors.Is(err, ErrWriteClosed) {
		t.Fatalf("write after CloseWrite = %v; want ErrWriteClosed", err)
	}
}

// A clean exchange on a moved connection (both sides half-close, read
// EOF, close) must not send the peer an Error{CANCELED}: it breaks the
// peer's connection (its relay's hook) as if it had been cut off sending.
func TestDirectCleanCloseSendsNoCancel(t *testing.T) {
	nc, ac := movedPair(t)
	defer ac.Close()
	if err := ac.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(nc); err != nil {
		t.Fatal(err)
	}
	if err := nc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(ac); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	// Whatever nc's Close sent is dispatched at the agent before a later
	// connection's first bytes: the lane keeps its order.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := nc.Session().Flush(ctx); err != nil {
		t.Fatal(err)
	}
	later, _ := openAccepted(t, nc.Session(), ac.Session())
	later.Close()
	if ac.isBroken() {
		t.Fatalf("the peer's clean Close after both EOFs broke this end: %v", ac.brokenErr())
	}
}

// The move gives the receive window's budget back while the bytes it
// admitted are still buffered (after a lane FIN the charge stays until the
// connection ends): the node's budget then undercounts what it holds.
func TestDirectMoveKeepsTheChargeOfBufferedBytes(t *testing.T) {
	budget := NewBudget(64 << 20)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis.Close()
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{Budget: budget}, Config{})
	nc, ac := openAccepted(t, node, agent)
	defer nc.Close()
	defer ac.Close()
	stop := make(chan struct{})
	go func() {
		chunk := make([]byte, 64<<10)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := ac.Write(chunk); err != nil {
				return
			}
		}
	}()
	// Read so the window grows, then stop reading.
	buf := make([]byte, 64<<10)
	for i := 0; i < 400 && budget.InUse() < 1<<20; i++ {
		io.ReadFull(nc, buf)
	}
	if budget.InUse() == 0 {
		t.Skip("window did not grow")
	}
	eventually(t, 5*time.Second, "the writer filling the grown window", func() bool { return nc.Buffered() > 1<<20 })
	held, charged := nc.Buffered(), budget.InUse()
	attachBoth(t, node, nc, ac) // the writer, blocked on credit, moves
	eventually(t, 5*time.Second, "the agent moved", func() bool {
		return nc.direct.Load().readMoved()
	})
	close(stop)
	t.Logf("before the move: %d buffered, budget %d; after: %d buffered, budget %d", held, charged, nc.Buffered(), budget.InUse())
	if nc.Buffered() > InitialWindow && budget.InUse() == 0 {
		t.Fatalf("%d bytes above the initial window still buffered, budget charge 0", nc.Buffered()-InitialWindow)
	}
}

// sockOf returns c's direct socket.
func sockOf(c *Conn) net.Conn {
	return c.direct.Load().socket()
}

// TestDirectFINThenAbortReadsEOF: the peer sends a whole stream, half-closes
// it, then aborts. On the lane the reader gets every byte and EOF (an abort
// after the FIN leaves them); on the socket it must too.
func TestDirectFINThenAbortReadsEOF(t *testing.T) {
	for _, direct := range []bool{false, true} {
		var nc, ac *Conn
		if direct {
			nc, ac = movedPair(t)
		} else {
			node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
			nc, ac = openAccepted(t, node, agent)
		}
		data := bytes.Repeat([]byte("z"), 32<<10)
		if _, err := ac.Write(data); err != nil {
			t.Fatal(err)
		}
		if err := ac.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if direct {
			eventually(t, 5*time.Second, "bytes and FIN acknowledged by the node's socket", func() bool { return sendQueue(sockOf(ac))() == 0 })
		} else {
			eventually(t, 5*time.Second, "FIN read", func() bool { nc.mu.Lock(); defer nc.mu.Unlock(); return nc.rstate == recvEOF })
		}
		ac.Abort(tunnelpb.Error_RESET, "upstream reset after its full answer")
		eventually(t, 5*time.Second, "the abort arrived", func() bool { return nc.peerErrOrNil() != nil })
		got, err := io.ReadAll(nc)
		if err != nil || len(got) != len(data) {
			t.Errorf("direct=%v: a complete FIN'd stream read %d/%d bytes, err %v; want all, then EOF", direct, len(got), len(data), err)
		}
		nc.Close()
	}
}

// TestDirectCloseWithUnreadBytesKeepsWhatWasWritten: Close right after a
// Write, while the peer had sent bytes this end never read (a server that
// answers an upload early): what was written reaches a peer that reads it
// only after this end's socket is gone (a reset would have dropped it).
func TestDirectCloseWithUnreadBytesKeepsWhatWasWritten(t *testing.T) {
	// The node's socket takes little at a time: what the agent writes
	// waits in the agent's socket.
	nc, ac := attachedPair(t, func(tc *net.TCPConn) { tc.SetReadBuffer(64 << 10) })
	if _, err := nc.Write(make([]byte, 64<<10)); err != nil { // never read by the agent
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("q"), 3<<20)
	wrote := make(chan error, 1)
	sock := sockOf(ac)
	go func() {
		_, err := ac.Write(data)
		if err == nil {
			err = ac.Close()
		}
		wrote <- err
	}()
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	// The slow reader starts once the agent closed its socket.
	eventually(t, 10*time.Second, "the agent's socket closed", func() bool { return socketClosed(sock) })
	got, err := io.ReadAll(nc)
	if len(got) != len(data) || err != nil {
		t.Fatalf("bytes written before Close lost: read %d of %d, err %v", len(got), len(data), err)
	}
}

// TestDirectConnEndingDuringDialKeepsTheSessionTrying: a connection that
// ends while its direct socket opens gets the node's "not open" answer,
// which leaves the session's other connections free to go direct.
func TestDirectConnEndingDuringDialKeepsTheSessionTrying(t *testing.T) {
	gate := make(chan struct{})
	node, agent := directPairWith(t, transport{"lane", lanePair}, 64<<10, directOpts{beforeDial: gate})
	nc, ac := openAccepted(t, node, agent)
	go func() { ac.Write(make([]byte, 128<<10)); ac.Close() }()
	io.ReadAll(nc)
	nc.Close()
	eventually(t, 5*time.Second, "the dial under way", func() bool { return dialState(ac) == directDialing })
	eventually(t, 5*time.Second, "the node forgot the connection", func() bool { return node.NumConns() == 0 })
	close(gate)
	eventually(t, 5*time.Second, "the dial ended", func() bool { return dialState(ac) == directFailed })
	if at := agent.directRetryAt.Load(); at > time.Now().UnixNano() {
		t.Fatalf("a connection that ended during its dial held the session's direct sockets off for %v", time.Until(time.Unix(0, at)).Round(time.Second))
	}
}

// TestDirectCloseWriteUnderABlockedWrite: CloseWrite while another
// goroutine's Write waits on the socket ends that Write at once with
// ErrWriteClosed, as on the lane.
func TestDirectCloseWriteUnderABlockedWrite(t *testing.T) {
	nc, ac := movedPair(t)
	defer nc.Close()
	defer ac.Close()
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 1<<20)
		for {
			if _, err := nc.Write(buf); err != nil {
				done <- err
				return
			}
		}
	}()
	eventually(t, 5*time.Second, "the writer blocked on a full socket", func() bool { return sendQueue(sockOf(nc))() > 256<<10 })
	start := time.Now()
	nc.CloseWrite()
	select {
	case err := <-done:
		if !errors.Is(err, ErrWriteClosed) {
			t.Fatalf("blocked Write after a concurrent CloseWrite: %v after %v; want ErrWriteClosed", err, time.Since(start))
		}
	case <-time.After(5 * time.Second):
		t.Fatal("blocked Write did not end after CloseWrite")
	}
}

// socketClosed reports whether sock's file descriptor is closed.
func socketClosed(sock net.Conn) bool {
	raw, err := tcpConnOf(sock).SyscallConn()
	return err != nil || raw.Control(func(uintptr) {}) != nil
}

// TestDirectDeadlineAfterCloseLeavesTheLingerBounded: a deadline set after
// Close (a server clearing its deadlines on the way out) does not reach
// the socket, whose close lingers at most directLinger.
func TestDirectDeadlineAfterCloseLeavesTheLingerBounded(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1<<40)
	nc, ac := openAccepted(t, node, agent)
	defer ac.Close()
	attachBoth(t, node, nc, ac)
	if _, err := nc.Write([]byte("y")); err != nil { // moves nc's direction only: the agent sends no FIN
		t.Fatal(err)
	}
	if _, err := io.ReadFull(ac, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	sock := sockOf(nc)
	nc.Close()
	nc.SetReadDeadline(time.Time{})
	eventually(t, 3*directLinger, "the closed connection's socket closed", func() bool { return socketClosed(sock) })
}

// stuckWriter blocks every Write until release is closed; entered tells
// that a Write began.
type stuckWriter struct{ entered, release chan struct{} }

func (w stuckWriter) Write(p []byte) (int, error) {
	select {
	case w.entered <- struct{}{}:
	default:
	}
	<-w.release
	return len(p), nil
}

// TestDirectCloseUnderAStuckWriteTo: a WriteTo blocked writing to its
// destination does not hold the close's linger back, so what this end
// wrote before Close reaches a peer that reads it after the socket closed.
func TestDirectCloseUnderAStuckWriteTo(t *testing.T) {
	// The node's socket takes little at a time: what the agent writes
	// waits in the agent's socket.
	nc, ac := attachedPair(t, func(tc *net.TCPConn) { tc.SetReadBuffer(64 << 10) })
	w := stuckWriter{entered: make(chan struct{}, 1), release: make(chan struct{})}
	defer close(w.release)
	go ac.WriteTo(w)
	go nc.Write(make([]byte, 2<<20)) // the agent's WriteTo takes a piece, then sticks
	select {
	case <-w.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent's WriteTo never wrote")
	}
	data := bytes.Repeat([]byte("q"), 3<<20)
	if _, err := ac.Write(data); err != nil {
		t.Fatal(err)
	}
	sock := sockOf(ac)
	ac.Close()
	eventually(t, 3*directLinger, "the agent's socket closed", func() bool { return socketClosed(sock) })
	got, err := io.ReadAll(nc)
	if len(got) != len(data) || err != nil {
		t.Fatalf("bytes written before Close lost: read %d of %d, err %v", len(got), len(data), err)
	}
}

// TestDirectCloseWriteOnAResetSocket: CloseWrite on a socket the peer reset
// reports the failure, not ErrWriteClosed.
func TestDirectCloseWriteOnAResetSocket(t *testing.T) {
	nc, ac := movedPair(t)
	defer nc.Close()
	tc := tcpConnOf(sockOf(ac))
	tc.SetLinger(0)
	tc.Close() // a reset, with no Error on the stream (a peer that died)
	sock := sockOf(nc)
	eventually(t, 5*time.Second, "the reset arrived", func() bool {
		sock.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
		_, err := sock.Read(make([]byte, 1))
		return errors.Is(err, syscall.ECONNRESET)
	})
	if err := nc.CloseWrite(); errors.Is(err, ErrWriteClosed) {
		t.Fatalf("CloseWrite on a reset socket = %v; want the failure", err)
	}
}

// dialState is the state of c's direct socket (0: none tried).
func dialState(c *Conn) int32 {
	if d := c.direct.Load(); d != nil {
		return d.state.Load()
	}
	return 0
}
