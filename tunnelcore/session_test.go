package tunnelcore

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRoundTripBothDirections(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		c, err := node.Open(ConnectInfo{RouteKey: "app.example.com", RemoteAddr: "127.0.0.1:5555"})
		if err != nil {
			t.Fatal(err)
		}
		up := randomBytes(t, 3<<20+17)
		down := randomBytes(t, 2<<20+5)

		var wg sync.WaitGroup
		wg.Add(1)
		go func() { // node writes, then half-closes
			defer wg.Done()
			if _, err := c.Write(up); err != nil {
				t.Errorf("node write: %v", err)
			}
			c.CloseWrite()
		}()

		ac := accept(t, agent)
		if got := ac.Info(); got.RouteKey != "app.example.com" || got.RemoteAddr != "127.0.0.1:5555" {
			t.Errorf("connect info = %+v", got)
		}
		gotUp, err := io.ReadAll(ac)
		if err != nil {
			t.Fatalf("agent read: %v", err)
		}
		if !bytes.Equal(gotUp, up) {
			t.Fatalf("node→agent: got %d bytes, want %d (content differs: %v)", len(gotUp), len(up), len(gotUp) == len(up))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := ac.Write(down); err != nil {
				t.Errorf("agent write: %v", err)
			}
			ac.Close()
		}()
		gotDown, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("node read: %v", err)
		}
		if !bytes.Equal(gotDown, down) {
			t.Fatalf("agent→node: got %d bytes, want %d", len(gotDown), len(down))
		}
		wg.Wait()
		c.Close()
		eventually(t, 5*time.Second, "both tables empty", func() bool {
			return node.NumConns() == 0 && agent.NumConns() == 0
		})
	})
}

func TestHalfCloseDeliversEOFAndAllowsReply(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		c, _ := node.Open(ConnectInfo{})
		if _, err := c.Write([]byte("request")); err != nil {
			t.Fatal(err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write([]byte("x")); !errors.Is(err, ErrWriteClosed) {
			t.Fatalf("write after CloseWrite: %v, want ErrWriteClosed", err)
		}
		ac := accept(t, agent)
		req, err := io.ReadAll(ac) // returns at EOF
		if err != nil || string(req) != "request" {
			t.Fatalf("agent read %q, %v", req, err)
		}
		if _, err := ac.Write([]byte("reply after EOF")); err != nil {
			t.Fatalf("reply after peer's half-close: %v", err)
		}
		ac.CloseWrite()
		resp, err := io.ReadAll(c)
		if err != nil || string(resp) != "reply after EOF" {
			t.Fatalf("node read %q, %v", resp, err)
		}
		c.Close()
		ac.Close()
	})
}

// TestHeadOfLineIsolation: one connection whose reader never reads does not
// hold back 8 others on the same session.
func TestHeadOfLineIsolation(t *testing.T) {
	const perConn = 8 << 20
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})

		stalled, _ := node.Open(ConnectInfo{RouteKey: "stalled"})
		stalledDone := make(chan struct{})
		go func() { // writes until the window is full, then blocks
			defer close(stalledDone)
			stalled.Write(make([]byte, 4<<20))
		}()
		stalledPeer := accept(t, agent) // never read

		payload := randomBytes(t, perConn)
		want := sha256.Sum256(payload)
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for i := 0; i < 8; i++ {
			c, err := node.Open(ConnectInfo{RouteKey: "busy"})
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := c.Write(payload); err != nil {
					errs <- err
				}
				c.CloseWrite()
			}()
		}
		for i := 0; i < 8; i++ {
			ac := accept(t, agent)
			if ac.Info().RouteKey == "stalled" {
				t.Fatal("unexpected second stalled connection")
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer ac.Close()
				h := sha256.New()
				n, err := io.Copy(h, ac)
				if err != nil {
					errs <- err
					return
				}
				if n != perConn || !bytes.Equal(h.Sum(nil), want[:]) {
					errs <- errors.New("payload mismatch")
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if b := stalledPeer.Buffered(); b > InitialWindow {
			t.Fatalf("stalled connection buffers %d bytes, more than its window %d", b, InitialWindow)
		}
		select {
		case <-stalledDone:
			t.Fatal("the stalled writer finished although its peer never read")
		default:
		}
		stalled.Close()
		stalledPeer.Close()
		<-stalledDone
	})
}

// TestMemoryBoundWithStoppedReaders: readers that read (so windows grow) and
// then stop hold at most 16 × 64 KiB plus the budget.
func TestMemoryBoundWithStoppedReaders(t *testing.T) {
	const conns = 16
	forEachTransport(t, func(t *testing.T, tr transport) {
		budget := NewBudget(2 << 20)
		node, agent := sessionPair(t, tr, Config{}, Config{Budget: budget})
		var writers sync.WaitGroup
		var peers []*Conn
		var opened []*Conn
		for i := 0; i < conns; i++ {
			c, _ := node.Open(ConnectInfo{})
			opened = append(opened, c)
			writers.Add(1)
			go func() {
				defer writers.Done()
				buf := make([]byte, 256<<10)
				for {
					if _, err := c.Write(buf); err != nil {
						return
					}
				}
			}()
		}
		for i := 0; i < conns; i++ {
			ac := accept(t, agent)
			peers = append(peers, ac)
			// Read a while so the window grows, then stop reading.
			if _, err := io.CopyN(io.Discard, ac, 4<<20); err != nil {
				t.Fatal(err)
			}
		}
		limit := int64(conns*InitialWindow) + budget.Limit()
		// Sample until the writers have filled every window they hold.
		var last int64
		stable := 0
		deadline := time.Now().Add(10 * time.Second)
		for stable < 50 && time.Now().Before(deadline) {
			b := agent.Stats().Buffered
			if b > limit {
				t.Fatalf("buffered %d bytes, bound is %d", b, limit)
			}
			if b == last {
				stable++
			} else {
				stable = 0
			}
			last = b
			time.Sleep(2 * time.Millisecond)
		}
		var sum int64
		for _, p := range peers {
			sum += int64(p.Buffered())
		}
		if sum > limit || budget.InUse() > budget.Limit() {
			t.Fatalf("buffered %d (bound %d), budget %d of %d", sum, limit, budget.InUse(), budget.Limit())
		}
		t.Logf("buffered %d bytes at rest across %d stopped readers (bound %d); budget in use %d", sum, conns, limit, budget.InUse())
		for _, c := range opened {
			c.Close()
		}
		for _, p := range peers {
			p.Close()
		}
		writers.Wait()
		eventually(t, 5*time.Second, "budget released", func() bool { return budget.InUse() == 0 })
		eventually(t, 5*time.Second, "buffers released", func() bool { return agent.Stats().Buffered == 0 })
	})
}

// rawPeer drives one end of a pipe by hand, to misbehave.
type rawPeer struct {
	t  testing.TB
	fs FrameStream
}

func (p rawPeer) send(f *tunnelpb.Frame) {
	if err := p.fs.Send(&tunnelpb.Envelope{Frame: f}); err != nil {
		p.t.Fatal(err)
	}
}

func (p rawPeer) data(id uint64, n int) {
	if err := p.fs.Send(&tunnelpb.Envelope{ConnID: id, Payload: mem.BufferSlice{mem.SliceBuffer(make([]byte, n))}}); err != nil {
		p.t.Fatal(err)
	}
}

// next returns the next frame that is not a DATA frame or a window update.
func (p rawPeer) nextControl() *tunnelpb.Frame {
	for {
		env := &tunnelpb.Envelope{}
		if err := p.fs.Recv(env); err != nil {
			p.t.Fatal(err)
		}
		if env.IsData() {
			env.Payload.Free()
			continue
		}
		if env.Frame.GetWindowUpdate() != nil {
			continue
		}
		return env.Frame
	}
}

// nextFrame returns the next frame that is not a DATA frame.
func (p rawPeer) nextFrame() *tunnelpb.Frame {
	for {
		env := &tunnelpb.Envelope{}
		if err := p.fs.Recv(env); err != nil {
			p.t.Fatal(err)
		}
		if !env.IsData() {
			return env.Frame
		}
		env.Payload.Free()
	}
}

func connectFrame(id uint64, window uint32) *tunnelpb.Frame {
	return &tunnelpb.Frame{Kind: &tunnelpb.Frame_Connect{Connect: &tunnelpb.Connect{ConnId: id, Window: window}}}
}

func TestCreditViolationFailsOnlyThatConnection(t *testing.T) {
	a, b := pipePair(t)
	agent, err := NewSession(a, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	peer := rawPeer{t, b} // a node that ignores credit

	peer.send(connectFrame(2, InitialWindow))
	peer.send(connectFrame(4, InitialWindow))
	bad, good := accept(t, agent), accept(t, agent)

	peer.data(2, InitialWindow)
	peer.data(2, 1) // one byte past the credit
	f := peer.nextControl()
	if e := f.GetError(); e == nil || e.ConnId != 2 || e.Code != tunnelpb.Error_FLOW_CONTROL {
		t.Fatalf("peer got %v, want Error FLOW_CONTROL for conn 2", f)
	}
	_, rerr := bad.Read(make([]byte, 1))
	if !errors.Is(rerr, ErrFlowControl) {
		t.Fatalf("read on violated conn: %v, want ErrFlowControl", rerr)
	}
	if _, werr := bad.Write([]byte("x")); !errors.Is(werr, ErrFlowControl) {
		t.Fatalf("write on violated conn: %v, want ErrFlowControl", werr)
	}
	// The session and the other connection go on.
	peer.data(4, 10)
	buf := make([]byte, 10)
	if _, err := io.ReadFull(good, buf); err != nil {
		t.Fatalf("other connection: %v", err)
	}
	if agent.Err() != nil {
		t.Fatalf("session failed: %v", agent.Err())
	}
	good.Close()
}

func TestConnectWithoutWindowIsRefused(t *testing.T) {
	a, b := pipePair(t)
	agent, _ := NewSession(a, Config{Role: RoleAgent})
	defer agent.Close()
	peer := rawPeer{t, b}
	peer.send(connectFrame(2, 0))
	f := peer.nextControl()
	if e := f.GetError(); e == nil || e.ConnId != 2 || e.Code != tunnelpb.Error_PROTOCOL {
		t.Fatalf("got %v, want Error PROTOCOL", f)
	}
}

func TestSessionDeathFailsEveryConnPromptly(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		nodeStream, agentStream := tr.pair(t)
		node, _ := NewSession(nodeStream, Config{Role: RoleNode})
		agent, _ := NewSession(agentStream, Config{Role: RoleAgent})
		defer node.Close()
		var conns []*Conn
		for i := 0; i < 5; i++ {
			c, _ := node.Open(ConnectInfo{})
			conns = append(conns, c)
			accept(t, agent)
		}
		// A writer blocked on credit and readers blocked on data.
		blockedWrite := make(chan error, 1)
		go func() {
			_, err := conns[0].Write(make([]byte, 1<<20))
			blockedWrite <- err
		}()
		readErrs := make(chan error, 4)
		for _, c := range conns[1:] {
			go func() {
				_, err := c.Read(make([]byte, 10))
				readErrs <- err
			}()
		}
		agent.Close() // the peer goes away: its stream ends

		timeout := time.After(5 * time.Second)
		for i := 0; i < 5; i++ {
			var err error
			select {
			case err = <-blockedWrite:
			case err = <-readErrs:
			case <-timeout:
				t.Fatal("connections were not failed promptly")
			}
			if !errors.Is(err, ErrSessionClosed) {
				t.Fatalf("got %v, want an error wrapping ErrSessionClosed", err)
			}
		}
		select {
		case <-node.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("node session did not notice")
		}
		if _, err := node.Open(ConnectInfo{}); !errors.Is(err, ErrSessionClosed) {
			t.Fatalf("open on dead session: %v", err)
		}
	})
}

func TestReadDeadlineTimesOut(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		c, _ := node.Open(ConnectInfo{})
		ac := accept(t, agent)
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("got %v, want a timeout net.Error", err)
		}
		// Clearing the deadline makes the connection usable again.
		c.SetReadDeadline(time.Time{})
		ac.Write([]byte("hi"))
		buf := make([]byte, 2)
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatal(err)
		}
		// A write deadline bounds a writer with no credit.
		c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
		_, err = c.Write(make([]byte, 2<<20))
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("write: got %v, want timeout", err)
		}
		c.Close()
		ac.Close()
	})
}

func TestAcceptBacklogFullRefuses(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{AcceptBacklog: 1})
	c1, _ := node.Open(ConnectInfo{})
	c2, _ := node.Open(ConnectInfo{})
	_, err := c2.Read(make([]byte, 1))
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_RESOURCE_EXHAUSTED {
		t.Fatalf("second conn: %v, want RESOURCE_EXHAUSTED", err)
	}
	ac := accept(t, agent)
	c1.Write([]byte("ok"))
	buf := make([]byte, 2)
	if _, err := io.ReadFull(ac, buf); err != nil {
		t.Fatal(err)
	}
	c1.Close()
	ac.Close()
}

func TestCloseWhilePeerSendsStopsThePeer(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		c, _ := node.Open(ConnectInfo{})
		ac := accept(t, agent)
		errc := make(chan error, 1)
		go func() {
			buf := make([]byte, 32<<10)
			for {
				if _, err := ac.Write(buf); err != nil {
					errc <- err
					return
				}
			}
		}()
		c.Close()
		select {
		case err := <-errc:
			if !errors.Is(err, ErrConnReset) {
				t.Fatalf("peer write: %v, want ErrConnReset", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("peer writer kept going after close")
		}
		ac.Close()
		eventually(t, 5*time.Second, "tables empty", func() bool { return node.NumConns() == 0 && agent.NumConns() == 0 })
	})
}

func TestOpenFromAgentSide(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	c, err := agent.Open(ConnectInfo{RouteKey: "reverse"})
	if err != nil {
		t.Fatal(err)
	}
	if c.ID()%2 != 1 {
		t.Fatalf("agent opened even id %d", c.ID())
	}
	c.Write([]byte("x"))
	nc := accept(t, node)
	b := make([]byte, 1)
	if _, err := io.ReadFull(nc, b); err != nil {
		t.Fatal(err)
	}
	c.Close()
	nc.Close()
}

func TestControlFramesReachOnControl(t *testing.T) {
	got := make(chan *tunnelpb.Frame, 1)
	_, agent := sessionPair(t, transports[0], Config{OnControl: func(f *tunnelpb.Frame) { got <- f }}, Config{})
	agent.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{AgentId: "a1"}}})
	select {
	case f := <-got:
		if f.GetAdvertise().GetAgentId() != "a1" {
			t.Fatalf("got %v", f)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no control frame")
	}
}

// TestFlushThenCloseDelivers: a session frame flushed before the session
// ends reaches the peer (closing drops what is still queued), also with a
// connection's data queued behind the peer's window.
func TestFlushThenCloseDelivers(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		for i := range 20 {
			got := make(chan *tunnelpb.Frame, 1)
			node, agent := sessionPair(t, tr, Config{}, Config{OnControl: func(f *tunnelpb.Frame) { got <- f }})
			nc, err := node.Open(ConnectInfo{})
			if err != nil {
				t.Fatal(err)
			}
			go nc.Write(make([]byte, 4*InitialWindow)) // more than the agent, which never reads, lets through
			node.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: &tunnelpb.AdvertiseAck{NodeId: "n1"}}})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err = node.Flush(ctx)
			cancel()
			if err != nil {
				t.Fatalf("round %d: Flush: %v", i, err)
			}
			node.CloseWithError(errors.New("leaving"))
			select {
			case f := <-got:
				if f.GetAdvertiseAck().GetNodeId() != "n1" {
					t.Fatalf("round %d: got %v", i, f)
				}
			case <-agent.Done():
				select {
				case <-got:
				default:
					t.Fatalf("round %d: the session ended without the flushed frame (%v)", i, agent.Err())
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: neither the frame nor the end", i)
			}
			if err := node.Flush(context.Background()); err == nil {
				t.Fatalf("round %d: Flush on an ended session returned nil", i)
			}
		}
	})
}

func TestAcceptHonoursContext(t *testing.T) {
	_, agent := sessionPair(t, transports[0], Config{}, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := agent.Accept(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v", err)
	}
}

// floodingPeer is a FrameStream whose peer opens connections as fast as the
// receive loop takes them, and takes whatever the session sends.
type floodingPeer struct {
	next    atomic.Uint64
	reached chan struct{} // closed once after connects have been received
	after   uint64
	closed  chan struct{}
	once    sync.Once
}

func (f *floodingPeer) Send(e *tunnelpb.Envelope) error {
	e.Payload.Free()
	select {
	case <-f.closed:
		return io.EOF
	default:
		return nil
	}
}

func (f *floodingPeer) Recv(e *tunnelpb.Envelope) error {
	select {
	case <-f.closed:
		return io.EOF
	default:
	}
	n := f.next.Add(1)
	if n == f.after {
		close(f.reached)
	}
	*e = tunnelpb.Envelope{Frame: connectFrame(2*n, InitialWindow)}
	return nil
}

func (f *floodingPeer) Close(error) { f.once.Do(func() { close(f.closed) }) }

// TestConnectRacingSessionCloseFreesItsSlot: a Connect dispatched while the
// session closes is either failed with the session or not created; it never
// stays in the table holding a node-wide slot, and an accepted connection
// of the dead session reads the session's error instead of spinning.
func TestConnectRacingSessionCloseFreesItsSlot(t *testing.T) {
	slots := NewSlots(0)
	for i := 0; i < 300; i++ {
		flood := &floodingPeer{reached: make(chan struct{}), after: uint64(1 + i%16), closed: make(chan struct{})}
		s, err := NewSession(flood, Config{Role: RoleAgent, Slots: slots, AcceptBacklog: 1 << 16})
		if err != nil {
			t.Fatal(err)
		}
		<-flood.reached // close at a varying point of the flood
		s.Close()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
			c, err := s.Accept(ctx)
			cancel()
			if err != nil {
				break
			}
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			if _, err := c.Read(make([]byte, 1)); !errors.Is(err, ErrSessionClosed) {
				t.Fatalf("iteration %d: Read on conn %d of a closed session: %v, want ErrSessionClosed", i, c.ID(), err)
			}
		}
		eventually(t, 2*time.Second, "closed session's table empty and its slots back", func() bool {
			return s.NumConns() == 0 && slots.InUse() == 0
		})
	}
}

// TestClientBytesThatAreNotUTF8FailNothing: a public client's SNI may be
// any bytes, and protobuf refuses to marshal a string that is not UTF-8.
// The Connect carries it made valid, and the session and the connection
// live on.
func TestClientBytesThatAreNotUTF8FailNothing(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		nc, err := node.Open(ConnectInfo{RouteKey: "r", ServerName: "\xffevil.example.com", RemoteAddr: "\xfe:1"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := nc.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		ac := accept(t, agent)
		if got, want := ac.Info().ServerName, "\uFFFDevil.example.com"; got != want {
			t.Errorf("ServerName %q, want %q", got, want)
		}
		if got, want := ac.Info().RemoteAddr, "\uFFFD:1"; got != want {
			t.Errorf("RemoteAddr %q, want %q", got, want)
		}
		buf := make([]byte, 4)
		if _, err := io.ReadFull(ac, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("read %q, %v", buf, err)
		}
		if err := node.Err(); err != nil {
			t.Fatalf("session ended: %v", err)
		}
	})
}

// gatedBatchStream is a batching stream whose DATA Sends each wait for a
// token on gate, and which holds control frames until Flush.
type gatedBatchStream struct {
	gate, closed chan struct{}
	once         sync.Once
	held         atomic.Int64
	dataWaiting  atomic.Int64
}

func (g *gatedBatchStream) Send(e *tunnelpb.Envelope) error {
	if e.IsData() {
		g.dataWaiting.Add(1)
		defer g.dataWaiting.Add(-1)
		select {
		case <-g.gate:
		case <-g.closed:
			return io.EOF
		}
	} else {
		g.held.Add(1)
	}
	e.Payload.Free()
	return nil
}
func (g *gatedBatchStream) Recv(*tunnelpb.Envelope) error { <-g.closed; return io.EOF }
func (g *gatedBatchStream) Close(error)                   { g.once.Do(func() { close(g.closed) }) }
func (g *gatedBatchStream) Flush() error                  { g.held.Store(0); return nil }
func (g *gatedBatchStream) Holding() bool                 { return g.held.Load() > 0 }

// TestFlushUnderLoadReturns: Flush on a batching stream (a lane) returns
// once what was queued before it is written, also while connections keep
// DATA queued, so that the sender never finds its queues empty.
func TestFlushUnderLoadReturns(t *testing.T) {
	g := &gatedBatchStream{gate: make(chan struct{}, 8), closed: make(chan struct{})}
	s, err := NewSession(g, Config{Role: RoleNode, PeerWindow: 1 << 20, MaxFrameSize: 16 << 10, SendQueue: 256 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := s.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	go c.Write(make([]byte, 8*(16<<10))) // eight DATA frames queued
	eventually(t, 5*time.Second, "the sender in the first DATA's Send", func() bool { return g.dataWaiting.Load() == 1 })

	s.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: &tunnelpb.AdvertiseAck{NodeId: "n1"}}})
	flushed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		flushed <- s.Flush(ctx)
	}()
	eventually(t, 5*time.Second, "the control frame and the Flush queued", func() bool {
		s.sender.mu.Lock()
		defer s.sender.mu.Unlock()
		return s.sender.ctrl.len() == 2
	})
	g.gate <- struct{}{} // the first DATA leaves; the sender goes on to the control frame, the mark, more DATA
	if err := <-flushed; err != nil {
		t.Fatalf("Flush under load: %v", err)
	}
}

// A session with RefuseOpens answers every connection its peer opens with
// REFUSED and that message, and has nothing to Accept.
func TestRefuseOpens(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{RefuseOpens: "no connections here"}, Config{})
		if _, err := node.Accept(t.Context()); !errors.Is(err, ErrAcceptRefused) {
			t.Fatalf("Accept: %v, want ErrAcceptRefused", err)
		}
		c, err := agent.Open(ConnectInfo{RouteKey: "x"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Read(make([]byte, 1))
		var pe *PeerError
		if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_REFUSED || pe.Message != "no connections here" {
			t.Fatalf("read on a refused connection: %v, want REFUSED %q", err, "no connections here")
		}
		if n := node.NumConns(); n != 0 {
			t.Fatalf("node holds %d connections, want 0", n)
		}
	})
}
