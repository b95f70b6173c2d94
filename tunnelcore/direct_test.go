package tunnelcore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// directKey is the key the test listener expects in a DirectHello.
const directKey = "0123456789abcdef0123456789abcdef"

// directPair is sessionPair with direct sockets: the agent opens them to a
// loopback listener that hands each to the node session, as the node's
// control listener does. above is the agent's DirectAbove; tune, if set,
// tunes the node's end of each direct socket.
func directPair(t *testing.T, tr transport, above int64, tune ...func(*net.TCPConn)) (node, agent *Session) {
	return directPairWith(t, tr, above, directOpts{tune: tune})
}

// directOpts varies directPair's sockets.
type directOpts struct {
	wrap       *socketWrap          // nil: plaintext
	tune       []func(*net.TCPConn) // applied to the node's end
	beforeDial <-chan struct{}      // nil, or the agent's dials wait for it
	nodeEnd    func(ConnEnd)        // the node's Config.OnConnEnd
	agentEnd   func(ConnEnd)        // the agent's Config.OnConnEnd
}

// socketWrap wraps both ends of a direct socket (TLS), the server's first.
type socketWrap struct {
	server, client func(raw net.Conn) net.Conn
}

// directPairWith is directPair with opts. The listener answers as the
// node's does (0x01, or 0x02 for a connection not open), and the dial
// reads the answer as the agent's presentHello does.
func directPairWith(t *testing.T, tr transport, above int64, opts directOpts) (node, agent *Session) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	var nodeSess atomic.Pointer[Session]
	go func() {
		for {
			raw, err := lis.Accept()
			if err != nil {
				return
			}
			for _, f := range opts.tune {
				f(raw.(*net.TCPConn))
			}
			go serveDirectSocket(raw, opts.wrap, &nodeSess)
		}
	}()
	agentCfg := Config{DirectAbove: above, DirectDial: func(ctx context.Context, id uint64) (net.Conn, error) {
		if opts.beforeDial != nil {
			<-opts.beforeDial
		}
		return dialDirectSocket(ctx, lis.Addr().String(), opts.wrap, id)
	}, OnConnEnd: opts.agentEnd}
	node, agent = sessionPair(t, tr, Config{OnConnEnd: opts.nodeEnd}, agentCfg)
	nodeSess.Store(node)
	return node, agent
}

// serveDirectSocket reads a direct socket's preface and gives it to the
// node session's connection, as the node's laneCreds does.
func serveDirectSocket(raw net.Conn, wrap *socketWrap, node *atomic.Pointer[Session]) {
	var c net.Conn = raw
	if wrap != nil {
		c = wrap.server(raw)
	}
	hello := make([]byte, tunnelpb.DirectHelloLength)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.ReadFull(c, hello)
	c.SetReadDeadline(time.Time{})
	key, id, perr := tunnelpb.ParseDirectHello(hello)
	if err != nil || perr != nil || key != directKey {
		c.Close()
		return
	}
	if err := node.Load().AttachDirect(id, OverSocket(c, raw)); err != nil {
		if errors.Is(err, ErrNotDirect) {
			c.Write([]byte{tunnelpb.DirectNotOpen})
		}
		c.Close()
	}
}

// dialDirectSocket opens a direct socket for connection id to addr and
// reads the node's answer, as the agent's dialLane does.
func dialDirectSocket(ctx context.Context, addr string, wrap *socketWrap, id uint64) (net.Conn, error) {
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := raw
	if wrap != nil {
		c = wrap.client(raw)
	}
	if _, err := c.Write(tunnelpb.DirectHello(directKey, id)); err != nil {
		c.Close()
		return nil, err
	}
	var answer [1]byte
	_, err = io.ReadFull(c, answer[:])
	switch {
	case err == nil && answer[0] == tunnelpb.LaneAccepted:
		return OverSocket(c, raw), nil
	case err == nil && answer[0] == tunnelpb.DirectNotOpen:
		err = ErrNotDirect
	case err == nil:
		err = errors.New("direct socket refused")
	}
	c.Close()
	return nil, err
}

// openAccepted opens a connection on node and accepts it on agent.
func openAccepted(t *testing.T, node, agent *Session) (nc, ac *Conn) {
	t.Helper()
	nc, err := node.Open(ConnectInfo{RouteKey: "r"})
	if err != nil {
		t.Fatal(err)
	}
	// The Connect travels with the first bytes.
	if _, err := nc.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	ac = accept(t, agent)
	one := make([]byte, 1)
	if _, err := io.ReadFull(ac, one); err != nil {
		t.Fatal(err)
	}
	return nc, ac
}

// sendAll writes data to c in pieces of step bytes, then half-closes.
func sendAll(c *Conn, data []byte, step int) error {
	for len(data) > 0 {
		n := min(step, len(data))
		if _, err := c.Write(data[:n]); err != nil {
			return err
		}
		data = data[n:]
	}
	return c.CloseWrite()
}

// TestDirectCarriesBothDirectionsInOrder: a connection moves to its
// direct socket in the middle of each direction's bytes, and each side
// reads every byte in order, then EOF.
func TestDirectCarriesBothDirectionsInOrder(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := directPair(t, tr, 256<<10)
		nc, ac := openAccepted(t, node, agent)
		down, up := randomBytes(t, 6<<20), randomBytes(t, 3<<20)

		errs := make(chan error, 2)
		go func() { errs <- sendAll(ac, down, 50_000) }()
		go func() { errs <- sendAll(nc, up, 70_000) }()
		gotDown, gotUp := make(chan []byte, 1), make(chan []byte, 1)
		go func() { b, _ := io.ReadAll(nc); gotDown <- b }()
		go func() { b, _ := io.ReadAll(ac); gotUp <- b }()
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		if b := <-gotDown; !bytes.Equal(b, down) {
			t.Fatalf("node read %d bytes, not the %d the agent sent, in order", len(b), len(down))
		}
		if b := <-gotUp; !bytes.Equal(b, up) {
			t.Fatalf("agent read %d bytes, not the %d the node sent, in order", len(b), len(up))
		}
		if !nc.Direct() || !ac.Direct() || node.Stats().Direct != 1 || agent.Stats().Direct != 1 {
			t.Fatalf("the connection did not move: node %v agent %v, stats %+v / %+v", nc.Direct(), ac.Direct(), node.Stats(), agent.Stats())
		}
		r, w := nc.Counts()
		if r != int64(len(down)) || w != int64(len(up)+1) {
			t.Fatalf("node Counts = %d read, %d written; want %d, %d", r, w, len(down), len(up)+1)
		}
		nc.Close()
		ac.Close()
	})
}

// TestDirectRelays: the relay paths (ReadFrom from a socket, WriteTo
// a socket) move a connection and carry a download and an upload intact.
func TestDirectRelays(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 64<<10)
	nc, ac := openAccepted(t, node, agent)
	upstream, agentSide := tcpPair(t)
	down, up := randomBytes(t, 8<<20), randomBytes(t, 2<<20)

	relayDone := make(chan RelayResult, 1)
	go func() { relayDone <- Relay(agentSide, ac) }()
	go func() {
		upstream.Write(down)
		upstream.CloseWrite()
	}()
	upGot := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(upstream); upGot <- b }()
	go sendAll(nc, up, 1<<20)
	b, err := io.ReadAll(nc)
	if err != nil || sha256.Sum256(b) != sha256.Sum256(down) {
		t.Fatalf("download: %d of %d bytes, err %v", len(b), len(down), err)
	}
	if got := <-upGot; !bytes.Equal(got, up) {
		t.Fatalf("upload: %d of %d bytes", len(got), len(up))
	}
	if !nc.Direct() {
		t.Fatal("the connection did not move to a direct socket")
	}
	nc.Close()
	select {
	case <-relayDone:
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not end")
	}
}

// TestDirectAbortReachesThePeer: an abort on a moved connection fails the
// peer's read with the abort's code, not a socket error or a clean EOF.
func TestDirectAbortReachesThePeer(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1)
	nc, ac := openAccepted(t, node, agent)
	if _, err := ac.Write(make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	if _, err := io.ReadFull(nc, make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	ac.Abort(tunnelpb.Error_RESET, "upstream reset")
	_, err := io.ReadAll(nc)
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_RESET {
		t.Fatalf("read after the peer's abort = %v; want its RESET", err)
	}
}

// TestDirectCloseDeliversWhatWasWritten: a connection closed right after
// its last write, while the peer is still sending, still delivers those
// bytes (the socket is not reset under them), then EOF.
func TestDirectCloseDeliversWhatWasWritten(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1)
	nc, ac := openAccepted(t, node, agent)
	if _, err := nc.Write([]byte("move")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	// The node keeps sending, unread.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		chunk := make([]byte, 32<<10)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := nc.Write(chunk); err != nil {
				return
			}
		}
	}()
	answer := randomBytes(t, 1<<20)
	if _, err := ac.Write(answer); err != nil {
		t.Fatal(err)
	}
	ac.Close()
	got, err := io.ReadAll(nc)
	if err != nil || !bytes.Equal(got, answer) {
		t.Fatalf("read %d of the %d bytes written before Close, err %v", len(got), len(answer), err)
	}
}

// TestDirectConnsEndWithTheSession: the session's end fails a moved
// connection's blocked read.
func TestDirectConnsEndWithTheSession(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1)
	nc, ac := openAccepted(t, node, agent)
	if _, err := nc.Write([]byte("move")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	if _, err := io.ReadFull(ac, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	read := make(chan error, 1)
	go func() { _, err := ac.Read(make([]byte, 10)); read <- err }()
	node.Close()
	select {
	case err := <-read:
		if err == nil || err == io.EOF {
			t.Fatalf("read after the session's end = %v; want an error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a moved connection's read outlived its session")
	}
}

// TestDirectDeadlines: deadlines set before and after the move apply to
// the socket.
func TestDirectDeadlines(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1)
	nc, ac := openAccepted(t, node, agent)
	nc.SetReadDeadline(time.Now().Add(time.Hour))
	if _, err := ac.Write([]byte("move")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	if _, err := io.ReadFull(nc, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	// The agent's writes move at its next write.
	if _, err := ac.Write([]byte("more")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(nc, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	nc.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	_, err := nc.Read(make([]byte, 1))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past the deadline on the socket = %v; want a timeout", err)
	}
}

// TestDirectDialFailureStaysOnTheStream: a direct socket that cannot be
// opened leaves the connection working on the stream.
func TestDirectDialFailureStaysOnTheStream(t *testing.T) {
	var tried atomic.Int32
	agentCfg := Config{DirectAbove: 1, DirectDial: func(ctx context.Context, id uint64) (net.Conn, error) {
		tried.Add(1)
		return nil, errors.New("no route")
	}}
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, agentCfg)
	nc, ac := openAccepted(t, node, agent)
	data := randomBytes(t, 2<<20)
	go sendAll(ac, data, 100_000)
	got, err := io.ReadAll(nc)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read %d of %d bytes, err %v", len(got), len(data), err)
	}
	if tried.Load() != 1 || nc.Direct() || ac.Direct() {
		t.Fatalf("tried %d times, direct %v/%v; want one try, on the stream", tried.Load(), nc.Direct(), ac.Direct())
	}
}

// TestDirectAttachRefusesUnknownConnections: the node takes a direct socket
// only for a connection it has open, and only once.
func TestDirectAttachRefusesUnknownConnections(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1<<40)
	nc, _ := openAccepted(t, node, agent)
	a, b := tcpPair(t)
	if err := node.AttachDirect(nc.ID()+100, a); !errors.Is(err, ErrNotDirect) {
		t.Fatalf("attach to an unknown connection = %v", err)
	}
	if err := node.AttachDirect(nc.ID(), a); err != nil {
		t.Fatal(err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(b, answer[:]); err != nil || answer[0] != tunnelpb.LaneAccepted {
		t.Fatalf("answer %v, %v", answer, err)
	}
	if err := node.AttachDirect(nc.ID(), b); !errors.Is(err, ErrNotDirect) {
		t.Fatalf("a second attach = %v", err)
	}
}

// TestDirectEarlyAnswerBeforeAReset: an upstream that answers an upload
// early and closes with the body unread resets its socket; the relay's
// abort must not reset the direct socket before the node has the answer.
func TestDirectEarlyAnswerBeforeAReset(t *testing.T) {
	// The node's socket takes little at a time, so that most of the answer
	// waits in the agent's socket, unacknowledged, when the abort comes.
	node, agent := directPair(t, transport{"lane", lanePair}, 1, func(c *net.TCPConn) { c.SetReadBuffer(4 << 10) })
	answer := randomBytes(t, 64<<10) // within the upstream's socket buffers: all of it leaves before its reset
	for i := range 10 {
		nc, ac := openAccepted(t, node, agent)
		upstream, agentSide := tcpPair(t)
		go Relay(agentSide, ac)
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		go nc.Write(make([]byte, 8<<20))
		upstream.Read(make([]byte, 1024)) // some of the upload
		eventually(t, 5*time.Second, "the agent's end on its direct socket", ac.Direct)
		upstream.Write(answer)
		upstream.Close() // with the body unread: a reset
		got, err := io.ReadAll(io.LimitReader(nc, int64(len(answer))))
		nc.Close()
		if !bytes.Equal(got, answer) {
			t.Fatalf("upload %d: the node read %d of the answer's %d bytes (%v)", i, len(got), len(answer), err)
		}
	}
}

// TestDirectCountsEachWrite: on the direct socket, Counts moves with each
// piece relayed, however small, as on the lane: an idle watcher polling it
// must see a trickle as activity.
func TestDirectCountsEachWrite(t *testing.T) {
	node, agent := directPair(t, transport{"lane", lanePair}, 1)
	nc, ac := openAccepted(t, node, agent)
	if _, err := ac.Write([]byte("move")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	upstream, agentSide := tcpPair(t)
	go ac.ReadFrom(agentSide)
	go io.Copy(io.Discard, nc)
	for i := range 3 {
		_, before := ac.Counts()
		if _, err := upstream.Write([]byte("tick")); err != nil {
			t.Fatal(err)
		}
		eventually(t, 5*time.Second, fmt.Sprintf("tick %d counted", i), func() bool {
			_, now := ac.Counts()
			return now == before+4
		})
	}
	nc.Close()
	ac.Close()
}
