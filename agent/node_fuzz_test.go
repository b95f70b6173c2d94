package agent

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// FuzzMisbehavingNode: a node that breaks the protocol in any way in a
// session (offers a lane and refuses it, sends any frames, in any order,
// on the stream or the lane, or bytes that are no frame, then ends the
// session in any way) can end that session, but the agent never panics,
// keeps running and reconnecting, connects to the node once it behaves,
// stops when cancelled, and leaves no goroutine behind.
//
// The first input byte picks what the node's response header offers and
// how the session ends; then each byte picks a frame (or a pause), the
// next ones its fields (see misbehavingNode.frame).
func FuzzMisbehavingNode(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 2, 1, 2, 4, 2, 3, 2, 9, 9, 5, 1})
	f.Add([]byte{1, 0, 1, 1, 0, 3, 4, 1, 40, 2, 1, 40, 12, 12, 4, 1})
	f.Add([]byte{3, 1, 2, 0, 2, 7, 1, 5, 3, 6, 2, 10, 5, 1, 2, 3, 4, 5})
	f.Add([]byte{9, 0, 1, 1, 0, 3, 12, 11, 7, 0, 255, 8, 9})
	f.Add([]byte{17, 0, 1, 1, 3, 4, 12, 13, 2, 1, 1, 255, 1, 255, 12, 3, 255, 255, 255, 255, 9})
	f.Add([]byte{5, 6, 4, 7, 100, 3, 2, 12, 12, 12, 12})
	f.Add([]byte{24, 10, 4, 0, 0, 0, 0})
	f.Add([]byte{}) // the node sends nothing at all
	echo := echoUpstream(f)
	dead := closedPort(f)
	f.Fuzz(func(t *testing.T, script []byte) {
		if len(script) > 256 {
			script = script[:256]
		}
		orig := append([]byte(nil), script...)
		hang := time.AfterFunc(30*time.Second, func() {
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			panic(fmt.Sprintf("input %v hangs:\n%s", orig, buf[:n]))
		})
		defer hang.Stop()
		before := runtime.NumGoroutine()

		node := newMisbehavingNode(t, script)
		cfg := testConfig(node.addr, "secret",
			Upstream{Name: "web", Host: "app.test", Target: "http://" + echo},
			Upstream{Name: "svc", Target: "tcp://" + echo},
			Upstream{Name: "dead", Target: "tcp://" + dead},
		)
		ag := startAgent(t, cfg, func(a *Agent) {
			// Fast enough that an execution takes milliseconds; the ack
			// timeout only bounds a session the node never ends.
			a.backoffInitial, a.backoffMax = time.Millisecond, 2*time.Millisecond
			a.ackTimeout = 2 * time.Second
			a.drainMargin = 100 * time.Millisecond
		})
		waitFor(t, 20*time.Second, "the agent to connect once the node behaves", func() bool {
			select {
			case err := <-ag.done:
				t.Fatalf("Run returned %v while the node was up", err)
			default:
			}
			return ag.State() == StateConnected && ag.NodeID() == goodNodeID
		})
		if err := ag.stop(t); err != nil {
			t.Fatalf("Run: %v", err)
		}
		if n := ag.ActiveConns(); n != 0 {
			t.Errorf("%d connections still active after Run returned", n)
		}
		node.stop()
		// What the execution started ends with it: the agent, its
		// connections and relays, both nodes' sessions.
		waitFor(t, 10*time.Second, "the goroutines to end", func() bool {
			return runtime.NumGoroutine() <= before+2
		})
	})
}

// TestFrameBesideLaneReconnectsAtOnce: a node that sends a frame on the
// gRPC stream while the session runs on the data lane ends the session,
// and the agent reconnects at once: it used to stop reading the stream
// after that frame and wait recvErrWait (2 s) for a status it never read.
// (FuzzMisbehavingNode found it.)
func TestFrameBesideLaneReconnectsAtOnce(t *testing.T) {
	// A lane offered and taken; an empty frame on the stream; pauses.
	node := newMisbehavingNode(t, []byte{1, 13, 9, 12, 3, 12, 3})
	start := time.Now()
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "svc", Target: "tcp://" + echoUpstream(t)}),
		func(a *Agent) { a.backoffInitial, a.backoffMax = time.Millisecond, 2*time.Millisecond })
	waitFor(t, 10*time.Second, "the agent to connect again", func() bool {
		return ag.State() == StateConnected && ag.NodeID() == goodNodeID
	})
	if !hasLog(ag.logs, "connection failed; retrying", "reason", errFrameBesideLane.Error()) {
		t.Fatal("the first session did not end for the frame beside the lane")
	}
	if took := time.Since(start); took >= recvErrWait/2 {
		t.Errorf("reconnected after %v", took)
	}
}

// goodNodeID is the node id of the sessions after the first, in which the
// node behaves.
const goodNodeID = "good-node"

// rawFrame is a message rawCodec sends as it is: bytes no Frame marshals to.
type rawFrame []byte

// rawCodec is tunnelpb.Codec that also sends rawFrames.
type rawCodec struct{ tunnelpb.Codec }

func (c rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if r, ok := v.(rawFrame); ok {
		return mem.BufferSlice{mem.SliceBuffer(r)}, nil
	}
	return c.Codec.Marshal(v)
}

// misbehavingNode is a node on loopback whose first session follows a
// script and whose later sessions behave (accept every route, then read
// and drop what the agent sends), so a test sees the agent recover. Its
// listener takes data lanes (proto/README §2.4) as a node's does.
type misbehavingNode struct {
	tunnelpb.UnimplementedTunnelServer

	script   []byte
	addr     string
	lis      *laneSplitListener
	srv      *grpc.Server
	attempts atomic.Int32
	// ticket is the lane ticket the first session offers; laneAnswer the
	// byte the node answers its lane hello with (0: none, it closes).
	ticket     string
	laneAnswer atomic.Uint32
	lanes      chan net.Conn
	handlers   sync.WaitGroup
	stopOnce   sync.Once
}

func newMisbehavingNode(t testing.TB, script []byte) *misbehavingNode {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &misbehavingNode{
		script: script,
		addr:   l.Addr().String(),
		srv:    grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{})),
		ticket: "0123456789abcdef0123456789abcdef",
		lanes:  make(chan net.Conn, 1),
	}
	n.lis = newLaneSplitListener(l, n.takeLane)
	tunnelpb.RegisterTunnelServer(n.srv, n)
	go n.srv.Serve(n.lis)
	t.Cleanup(n.stop)
	return n
}

func (n *misbehavingNode) stop() {
	n.stopOnce.Do(func() {
		n.srv.Stop()
		n.lis.Close()
		n.handlers.Wait()
		n.lis.wait()
		select {
		case c := <-n.lanes: // a lane the session never took
			c.Close()
		default:
		}
	})
}

func (n *misbehavingNode) Connect(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	n.handlers.Add(1)
	defer n.handlers.Done()
	if n.attempts.Add(1) > 1 {
		return n.behave(st)
	}
	s := &script{ops: n.script}
	return n.misbehave(st, s)
}

// behave runs a session as a node does: Advertise in, AdvertiseAck out.
func (n *misbehavingNode) behave(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	adv, err := awaitAdvertise(st)
	if err != nil {
		return err
	}
	ack := acceptAll(adv)
	ack.NodeId = goodNodeID
	if err := st.SendMsg(&tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}}}); err != nil {
		return err
	}
	for {
		env := &tunnelpb.Envelope{}
		if err := st.RecvMsg(env); err != nil {
			return nil
		}
		env.Payload.Free()
	}
}

// script hands out the bytes of a fuzz input; past its end it gives 0.
type script struct{ ops []byte }

func (s *script) next() uint64 {
	if len(s.ops) == 0 {
		return 0
	}
	b := s.ops[0]
	s.ops = s.ops[1:]
	return uint64(b)
}

// str returns the next n bytes (fewer at the end) as a string protobuf
// takes: valid UTF-8.
func (s *script) str(n int) string {
	return strings.ToValidUTF8(string(s.bytes(n)), "?")
}

// bytes returns the next n bytes (fewer at the end).
func (s *script) bytes(n int) []byte {
	n = min(n, len(s.ops))
	b := s.ops[:n]
	s.ops = s.ops[n:]
	return b
}

// misbehave runs the first session. The first byte: bit 0 offers a lane,
// bit 1 a direct socket key, bit 2 answers the lane hello with a byte that
// is not LaneAccepted, bits 3-4 pick how the session ends.
func (n *misbehavingNode) misbehave(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame], s *script) error {
	flags := s.next()
	md := metadata.MD{}
	if flags&1 != 0 {
		answer := uint32(tunnelpb.LaneAccepted)
		if flags&4 != 0 {
			answer = tunnelpb.DirectNotOpen
		}
		n.laneAnswer.Store(answer)
		md.Set(tunnelpb.LaneHeader, n.ticket)
	}
	if flags&2 != 0 {
		md.Set(tunnelpb.DirectHeader, strings.Repeat("ab", tunnelpb.DirectKeyLength/2))
	}
	if err := st.SendHeader(md); err != nil {
		return err
	}
	firstOnStream := make(chan struct{})
	go func() { // reads and drops what the agent sends on the stream
		first := true
		for {
			env := &tunnelpb.Envelope{}
			if st.RecvMsg(env) != nil {
				return
			}
			env.Payload.Free()
			if first {
				first = false
				close(firstOnStream)
			}
		}
	}()
	// The agent sends its Advertise on the lane it opened, or on the stream.
	var lane net.Conn
	select {
	case lane = <-n.lanes:
		defer lane.Close()
		dropped := make(chan struct{})
		go func() { io.Copy(io.Discard, lane); close(dropped) }()
		defer func() { lane.Close(); <-dropped }()
	case <-firstOnStream:
	case <-time.After(5 * time.Second):
		return status.Error(codes.DeadlineExceeded, "no Advertise")
	case <-st.Context().Done():
		return st.Context().Err()
	}
	send := func(b []byte, onStream bool) error {
		if lane == nil || onStream {
			return st.SendMsg(rawFrame(b))
		}
		// proto/README §2.4: the frames travel as gRPC messages do.
		msg := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(b)))
		_, err := lane.Write(append(msg, b...))
		return err
	}
	for len(s.ops) > 0 {
		b, onStream := n.frame(s, lane != nil)
		if b == nil {
			continue
		}
		if err := send(b, onStream); err != nil {
			break // the agent ended the session
		}
	}
	switch flags >> 3 & 3 {
	case 0:
		return nil
	case 1:
		return status.Error(codes.Unavailable, "the node is going away")
	case 2:
		if lane != nil { // the lane ends before the stream's status
			lane.Close()
			time.Sleep(time.Millisecond)
		}
		return status.Error(codes.ResourceExhausted, "too many")
	default:
		return status.Error(codes.Unauthenticated, "token revoked")
	}
}

// routeKeys are the route keys Connect frames name: the agent's, and some
// it does not have.
var routeKeys = []string{"web", "svc", "dead", "", "nope", ":80", "*"}

// frame returns the next frame of the script as the bytes to send, and
// whether it goes on the stream although the session is on a lane; nil
// when the op is a pause (an empty message is []byte{}).
func (n *misbehavingNode) frame(s *script, onLane bool) (b []byte, onStream bool) {
	var fr *tunnelpb.Frame
	op := s.next()
	switch op % 14 {
	case 0:
		ack := &tunnelpb.AdvertiseAck{NodeId: fmt.Sprintf("fuzz-%d", s.next()), InitialWindow: uint32(s.next()) << (s.next() % 32)}
		for range s.next() % 4 {
			ack.Accepted = append(ack.Accepted, &tunnelpb.RouteKey{Name: routeKeys[s.next()%uint64(len(routeKeys))]})
		}
		for range s.next() % 4 {
			ack.Rejected = append(ack.Rejected, &tunnelpb.RejectedRoute{
				Name: routeKeys[s.next()%uint64(len(routeKeys))], ListenPort: uint32(s.next()), Reason: s.str(8),
			})
		}
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}}
	case 1:
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Connect{Connect: &tunnelpb.Connect{
			ConnId: s.next(), RouteKey: routeKeys[s.next()%uint64(len(routeKeys))],
			RemoteAddr: s.str(int(s.next() % 24)), ServerName: "app.test",
			Window: uint32(s.next()) << (s.next() % 32),
		}}}
	case 2: // DATA the way a node sends it, for any id, of any length
		id, size := s.next(), int(s.next())*300
		e := &tunnelpb.Envelope{ConnID: id, Payload: mem.BufferSlice{mem.SliceBuffer(make([]byte, size))}}
		m, err := tunnelpb.Codec{}.Marshal(e)
		if err != nil {
			panic(err)
		}
		return m.Materialize(), op%28 == 16 // never empty
	case 3:
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{
			ConnId: s.next(), Increment: uint32(s.next()) << (s.next() % 32), Blocked: s.next()%2 == 0,
			ReclaimAbove: uint32(s.next()) << 10, Released: uint32(s.next()) << (s.next() % 32),
		}}}
	case 4:
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: s.next(), Moved: s.next()%4 == 0}}}
	case 5:
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Error{Error: &tunnelpb.Error{ConnId: s.next(), Code: tunnelpb.Error_Code(s.next() % 12), Message: s.str(8)}}}
	case 6:
		mu := &tunnelpb.MembershipUpdate{}
		for range s.next() % 4 {
			mu.Nodes = append(mu.Nodes, &tunnelpb.Node{Id: s.str(4), Url: s.str(int(s.next() % 16))})
		}
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_MembershipUpdate{MembershipUpdate: mu}}
	case 7:
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: uint32(s.next()) << (s.next() % 32), Reason: s.str(4)}}}
	case 8: // a frame only agents send
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{AgentId: "a"}}}
	case 9:
		fr = &tunnelpb.Frame{}
	case 10: // bytes that may be no frame at all
		return append([]byte{}, s.bytes(int(s.next()%32))...), false
	case 11: // a Data frame that is not DATA's hand-written form
		fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Data{Data: &tunnelpb.Data{ConnId: s.next(), Payload: s.bytes(int(s.next() % 16))}}}
	case 12: // a pause, so the agent acts on what it got so far
		time.Sleep(time.Duration(s.next()%4) * time.Millisecond)
		return nil, false
	case 13: // the next frame goes on the stream beside the lane
		b, _ := n.frame(s, onLane)
		return b, true
	}
	m, err := tunnelpb.Codec{}.Marshal(&tunnelpb.Envelope{Frame: fr})
	if err != nil {
		panic(err)
	}
	// Frame{} marshals to no bytes: an empty message, not a pause.
	return append([]byte{}, m.Materialize()...), false
}

// takeLane reads the lane hello on c (its first byte read) and, when it
// carries the ticket offered, answers laneAnswer and hands the lane to the
// session; otherwise it closes c, as a node does.
func (n *misbehavingNode) takeLane(c net.Conn) {
	hello := make([]byte, tunnelpb.LaneHelloLength)
	hello[0] = tunnelpb.LanePreface[0]
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.ReadFull(c, hello[1:]); err != nil {
		c.Close()
		return
	}
	ticket, err := tunnelpb.ParseLaneHello(hello)
	answer := byte(n.laneAnswer.Load())
	if err != nil || ticket != n.ticket || answer == 0 {
		c.Close()
		return
	}
	c.Write([]byte{answer})
	c.SetDeadline(time.Time{})
	if answer != tunnelpb.LaneAccepted {
		c.Close()
		return
	}
	select {
	case n.lanes <- c:
	default:
		c.Close()
	}
}

// laneSplitListener hands gRPC the connections that start as HTTP/2 does
// and lane the ones that start with the lane preface's first byte.
type laneSplitListener struct {
	net.Listener
	lane      func(net.Conn)
	conns     chan net.Conn
	done      chan struct{}
	closeOnce sync.Once
	splits    sync.WaitGroup
}

func newLaneSplitListener(l net.Listener, lane func(net.Conn)) *laneSplitListener {
	s := &laneSplitListener{Listener: l, lane: lane, conns: make(chan net.Conn), done: make(chan struct{})}
	s.splits.Add(1)
	go s.acceptLoop()
	return s
}

func (l *laneSplitListener) acceptLoop() {
	defer l.splits.Done()
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return
		}
		l.splits.Add(1)
		go l.split(c)
	}
}

// split reads c's first byte to tell a lane from gRPC.
func (l *laneSplitListener) split(c net.Conn) {
	defer l.splits.Done()
	var first [1]byte
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.ReadFull(c, first[:]); err != nil {
		c.Close()
		return
	}
	c.SetReadDeadline(time.Time{})
	if first[0] == tunnelpb.LanePreface[0] {
		l.lane(c)
		return
	}
	select {
	case l.conns <- &peekedConn{Conn: c, first: first[0], unread: true}:
	case <-l.done:
		c.Close()
	}
}

func (l *laneSplitListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *laneSplitListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// wait waits for the connections being split after Close.
func (l *laneSplitListener) wait() { l.splits.Wait() }

// peekedConn gives back the first byte split read.
type peekedConn struct {
	net.Conn
	first  byte
	unread bool
}

func (p *peekedConn) Read(b []byte) (int, error) {
	if p.unread && len(b) > 0 {
		p.unread = false
		b[0] = p.first
		return 1, nil
	}
	return p.Conn.Read(b)
}
