package tunnelcore

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// flowPair opens a datagram flow from the node and accepts it on the
// agent.
func flowPair(t testing.TB, tr transport, nodeCfg, agentCfg Config) (node, agent *Session, nf, af *Conn) {
	t.Helper()
	node, agent = sessionPair(t, tr, nodeCfg, agentCfg)
	nf, af = openFlow(t, node, agent)
	return node, agent, nf, af
}

// openFlow opens a datagram flow on node and accepts it on agent.
func openFlow(t testing.TB, node, agent *Session) (nf, af *Conn) {
	t.Helper()
	nf, err := node.Open(ConnectInfo{RouteKey: "dns", RemoteAddr: "192.0.2.7:5353", Datagram: true})
	if err != nil {
		t.Fatal(err)
	}
	af = accept(t, agent)
	t.Cleanup(func() { nf.Close(); af.Close() })
	return nf, af
}

// datagram is a datagram of n bytes that names its sequence number i in
// its first bytes and is otherwise a pattern of i.
func datagram(i, n int) []byte {
	p := bytes.Repeat([]byte{byte(i), byte(i >> 8), 0xa5}, n/3+1)[:n]
	copy(p, fmt.Sprintf("%06d", i))
	return p
}

// datagramSizes cover the edges: empty, tiny, around the exact/pool
// boundary (minFrameCharge), a gRPC frame, and the largest.
var datagramSizes = []int{0, 1, 7, 512, 1472, minFrameCharge - 1, minFrameCharge, minFrameCharge + 1, 16 << 10, 16<<10 + 1, 65000, MaxDatagram}

// TestFlowKeepsDatagramBoundaries: each datagram written is read whole,
// as one, both ways, from empty to 65535 bytes, on every transport; the
// accepted flow says what it is.
func TestFlowKeepsDatagramBoundaries(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		var nodeCounts Counters
		_, _, nf, af := flowPair(t, tr, Config{Counters: &nodeCounts}, Config{})
		if !af.Datagram() || !af.Info().Datagram || af.Info().RouteKey != "dns" || af.Info().RemoteAddr != "192.0.2.7:5353" {
			t.Fatalf("accepted %+v (datagram %v)", af.Info(), af.Datagram())
		}
		if a, ok := af.RemoteAddr().(*net.UDPAddr); !ok || a.String() != "192.0.2.7:5353" {
			t.Errorf("RemoteAddr %v (%T), want the client's UDP address", af.RemoteAddr(), af.RemoteAddr())
		}
		for dir, ends := range [][2]*Conn{{nf, af}, {af, nf}} {
			w, r := ends[0], ends[1]
			for i, n := range datagramSizes {
				if err := w.WriteDatagram(datagram(i, n)); err != nil {
					t.Fatalf("dir %d: write %d bytes: %v", dir, n, err)
				}
			}
			buf := make([]byte, MaxDatagram+10)
			for i, n := range datagramSizes {
				m, err := r.ReadDatagram(buf)
				if err != nil || !bytes.Equal(buf[:m], datagram(i, n)) {
					t.Fatalf("dir %d: datagram %d: read %d bytes, %v; want %d bytes as sent", dir, i, m, err, n)
				}
			}
		}
		if s := nf.FlowStats(); s.Sent != int64(len(datagramSizes)) || s.Received != int64(len(datagramSizes)) {
			t.Errorf("node flow stats %+v", s)
		}
		if got := nodeCounts.Flows.DatagramsSent.Load(); got != int64(len(datagramSizes)) {
			t.Errorf("session counted %d datagrams sent", got)
		}
		read, written := nf.Counts()
		var total int64
		for _, n := range datagramSizes {
			total += int64(n)
		}
		if read != total || written != total || nodeCounts.Flows.BytesSent.Load() != total {
			t.Errorf("counts read %d written %d, bytes sent %d; want %d", read, written, nodeCounts.Flows.BytesSent.Load(), total)
		}
	})
}

// TestFlowReadWriteAreDatagrams: Read and Write of a flow's net.Conn move
// one datagram each; a short buffer truncates a datagram as a UDP socket
// does, and the next Read starts at the next datagram.
func TestFlowReadWriteAreDatagrams(t *testing.T) {
	_, _, nf, af := flowPair(t, transports[0], Config{}, Config{})
	for _, p := range []string{"first datagram", "second", ""} {
		if n, err := nf.Write([]byte(p)); n != len(p) || err != nil {
			t.Fatalf("Write %q: %d, %v", p, n, err)
		}
	}
	short := make([]byte, 5)
	if n, err := af.Read(short); n != 5 || err != nil || string(short) != "first" {
		t.Fatalf("short read: %d %q %v", n, short[:n], err)
	}
	buf := make([]byte, 100)
	if n, err := af.Read(buf); err != nil || string(buf[:n]) != "second" {
		t.Fatalf("next read: %q %v; want the next datagram whole", buf[:n], err)
	}
	if n, err := af.Read(buf); err != nil || n != 0 {
		t.Fatalf("empty datagram: %d, %v", n, err)
	}
}

// TestFlowCopiesWithIOCopy: io.Copy into and out of a flow (ReadFrom,
// WriteTo) keeps datagrams whole and never waits on credit.
func TestFlowCopiesWithIOCopy(t *testing.T) {
	_, _, nf, af := flowPair(t, transports[0], Config{}, Config{})
	src := &datagramReader{n: 50, size: 3000}
	if n, err := io.Copy(nf, src); err != nil || n != 50*3000 {
		t.Fatalf("io.Copy into the flow: %d, %v", n, err)
	}
	nf.CloseWrite()
	dst := &datagramWriter{}
	if n, err := io.Copy(dst, af); err != nil || n != 50*3000 {
		t.Fatalf("io.Copy out of the flow: %d, %v", n, err)
	}
	if len(dst.got) != 50 {
		t.Fatalf("%d writes, want 50 datagrams", len(dst.got))
	}
	for i, p := range dst.got {
		if !bytes.Equal(p, datagram(i, 3000)) {
			t.Fatalf("datagram %d differs", i)
		}
	}
}

// datagramReader returns n datagrams, one per Read, then io.EOF.
type datagramReader struct{ i, n, size int }

func (r *datagramReader) Read(p []byte) (int, error) {
	if r.i == r.n {
		return 0, io.EOF
	}
	r.i++
	return copy(p, datagram(r.i-1, r.size)), nil
}

// datagramWriter keeps each Write.
type datagramWriter struct{ got [][]byte }

func (w *datagramWriter) Write(p []byte) (int, error) {
	w.got = append(w.got, append([]byte(nil), p...))
	return len(p), nil
}

// TestFlowRefusesTooLarge: a datagram over 65535 bytes is refused by the
// writer, and dropped by a receiver that gets one anyway; both count it,
// and the flow goes on.
func TestFlowRefusesTooLarge(t *testing.T) {
	var counts Counters
	_, _, nf, af := flowPair(t, transports[0], Config{Counters: &counts}, Config{})
	if err := nf.WriteDatagram(make([]byte, MaxDatagram+1)); !errors.Is(err, ErrDatagramTooLarge) {
		t.Fatalf("write of 65536 bytes: %v, want ErrDatagramTooLarge", err)
	}
	if s := nf.FlowStats(); s.DroppedTooLarge != 1 || counts.Flows.DroppedTooLarge.Load() != 1 {
		t.Errorf("stats %+v, counters %d", s, counts.Flows.DroppedTooLarge.Load())
	}
	if err := nf.WriteDatagram([]byte("ok")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 10)
	if n, err := af.ReadDatagram(buf); err != nil || string(buf[:n]) != "ok" {
		t.Fatalf("read %q %v", buf[:n], err)
	}

	// A peer that sends one anyway.
	a, b := pipePair(t)
	var agentCounts Counters
	agent, err := NewSession(a, Config{Role: RoleAgent, Counters: &agentCounts})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	peer := rawPeer{t, b}
	peer.send(flowConnect(2))
	f := accept(t, agent)
	peer.data(2, MaxDatagram+1)
	peer.data(2, 3)
	if n, err := f.ReadDatagram(buf); err != nil || n != 3 {
		t.Fatalf("read after an oversized datagram: %d, %v; want the next one", n, err)
	}
	if s := f.FlowStats(); s.DroppedTooLarge != 1 || s.Received != 1 || agentCounts.Flows.DroppedTooLarge.Load() != 1 {
		t.Errorf("receiver stats %+v", s)
	}
}

func flowConnect(id uint64) *tunnelpb.Frame {
	return &tunnelpb.Frame{Kind: &tunnelpb.Frame_Connect{Connect: &tunnelpb.Connect{ConnId: id, RouteKey: "dns", Datagram: true}}}
}

// TestFlowConnectOnTheWire: a flow's Connect says so and grants no window
// (window 0, which a peer that predates flows refuses as a connection),
// while a connection's Connect with window 0 is still refused.
func TestFlowConnectOnTheWire(t *testing.T) {
	a, b := pipePair(t)
	node, err := NewSession(a, Config{Role: RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	peer := rawPeer{t, b}
	if _, err := node.Open(ConnectInfo{RouteKey: "dns", Datagram: true}); err != nil {
		t.Fatal(err)
	}
	f := peer.nextFrame()
	if c := f.GetConnect(); c == nil || !c.Datagram || c.Window != 0 || c.RouteKey != "dns" {
		t.Fatalf("flow's Connect: %v", f)
	}

	a2, b2 := pipePair(t)
	agent, err := NewSession(a2, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	raw := rawPeer{t, b2}
	raw.send(connectFrame(2, 0))
	if e := raw.nextControl().GetError(); e == nil || e.ConnId != 2 || e.Code != tunnelpb.Error_PROTOCOL {
		t.Fatalf("connection with window 0: got %v, want Error PROTOCOL", e)
	}
	raw.send(flowConnect(4))
	if f := accept(t, agent); f.ID() != 4 || !f.Datagram() {
		t.Fatalf("accepted %d, datagram %v", f.ID(), f.Datagram())
	}
}

// TestFlowIgnoresCredit: a flow's peer may send any number of datagrams
// without a grant (no FLOW_CONTROL), grants nothing back, and WindowUpdate
// frames for a flow change nothing.
func TestFlowIgnoresCredit(t *testing.T) {
	a, b := pipePair(t)
	agent, err := NewSession(a, Config{Role: RoleAgent, DatagramQueue: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	peer := rawPeer{t, b}
	peer.send(flowConnect(2))
	f := accept(t, agent)
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: 2, Increment: 5, ReclaimAbove: 1}}})
	const n = 40 // 40 × 16 KiB: ten initial windows
	for range n {
		peer.data(2, 16<<10)
	}
	buf := make([]byte, MaxDatagram)
	for i := range n {
		if m, err := f.ReadDatagram(buf); err != nil || m != 16<<10 {
			t.Fatalf("datagram %d: %d, %v", i, m, err)
		}
	}
	if err := f.WriteDatagram([]byte("reply")); err != nil {
		t.Fatal(err)
	}
	// The first frame back is the reply: no grant, no reclaim answer.
	env := &tunnelpb.Envelope{}
	if err := b.Recv(env); err != nil {
		t.Fatal(err)
	}
	if !env.IsData() || env.ConnID != 2 || string(env.Payload.Materialize()) != "reply" {
		t.Fatalf("first frame from the flow: %+v, want the reply alone", env.Frame)
	}
	env.Payload.Free()
}

// TestFlowCloseEndsBothWays: Close delivers what was queued, then the
// peer reads io.EOF and its writes fail; the relay-facing errors are the
// connection's.
func TestFlowCloseEndsBothWays(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		var counts Counters
		_, _, nf, af := flowPair(t, tr, Config{Counters: &counts}, Config{})
		for i := range 3 {
			if err := nf.WriteDatagram(datagram(i, 100)); err != nil {
				t.Fatal(err)
			}
		}
		nf.Close()
		buf := make([]byte, 200)
		for i := range 3 {
			if n, err := af.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:n], datagram(i, 100)) {
				t.Fatalf("datagram %d: %v", i, err)
			}
		}
		if _, err := af.ReadDatagram(buf); err != io.EOF {
			t.Fatalf("read after the peer's Close: %v, want io.EOF", err)
		}
		eventually(t, 5*time.Second, "the peer's write to fail", func() bool {
			return af.WriteDatagram([]byte("late")) != nil
		})
		if err := nf.WriteDatagram([]byte("x")); err == nil {
			t.Fatal("write after Close succeeded")
		}
		eventually(t, 5*time.Second, "no flow active", func() bool { return counts.Flows.Active.Load() == 0 })
		if counts.Flows.Opened.Load() != 1 || counts.Flows.IdleEnded.Load() != 0 {
			t.Errorf("opened %d, idle ended %d", counts.Flows.Opened.Load(), counts.Flows.IdleEnded.Load())
		}
	})
}

// TestFlowDataAfterCloseFails: a datagram after the peer's Close is a
// protocol error, as DATA after a connection's FIN.
func TestFlowDataAfterCloseFails(t *testing.T) {
	a, b := pipePair(t)
	agent, err := NewSession(a, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	peer := rawPeer{t, b}
	peer.send(flowConnect(2))
	f := accept(t, agent)
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: 2}}})
	peer.data(2, 10)
	if e := peer.nextControl().GetError(); e == nil || e.Code != tunnelpb.Error_PROTOCOL {
		t.Fatalf("got %v, want Error PROTOCOL", e)
	}
	if _, err := f.ReadDatagram(make([]byte, 10)); !errors.Is(err, ErrConnReset) {
		t.Fatalf("read: %v", err)
	}
}

// TestFlowNeverGoesDirect: a flow takes no direct socket, however much it
// carries, and refuses one the peer attaches.
func TestFlowNeverGoesDirect(t *testing.T) {
	node, agent := directPair(t, transports[2], 1)
	nf, af := openFlow(t, node, agent)
	for i := range 20 {
		if err := af.WriteDatagram(datagram(i, 60000)); err != nil {
			t.Fatal(err)
		}
		if _, err := nf.ReadDatagram(make([]byte, MaxDatagram)); err != nil {
			t.Fatal(err)
		}
	}
	if nf.Direct() || af.Direct() || agent.Stats().Direct != 0 {
		t.Fatal("a flow moved to a direct socket")
	}
	client, server := tcpPair(t)
	if err := node.AttachDirect(nf.ID(), server); !errors.Is(err, ErrNotDirect) {
		t.Fatalf("AttachDirect on a flow: %v, want ErrNotDirect", err)
	}
	client.Close()
}

// TestFlowNotFlowErrors: the datagram calls refuse a connection.
func TestFlowNotFlowErrors(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	c, err := node.Open(ConnectInfo{RouteKey: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer accept(t, agent).Close()
	if c.Datagram() || c.FlowStats() != (FlowStats{}) {
		t.Fatal("a connection says it is a flow")
	}
	for _, err := range []error{c.WriteDatagram(nil), c.SetIdleTimeout(time.Second), func() error { _, err := c.ReadDatagram(nil); return err }()} {
		if !errors.Is(err, ErrNotFlow) {
			t.Errorf("got %v, want ErrNotFlow", err)
		}
	}
}

// TestFlowConfig: DatagramQueue must hold one datagram of the largest
// size; the defaults fill in.
func TestFlowConfig(t *testing.T) {
	c := Config{}
	if err := c.Validate(); err != nil || c.DatagramQueue != DefaultDatagramQueue || c.FlowIdleTimeout != DefaultFlowIdleTimeout {
		t.Fatalf("defaults: %v %+v", err, c)
	}
	c = Config{DatagramQueue: MaxDatagram}
	if err := c.Validate(); err == nil {
		t.Fatal("a queue smaller than one largest datagram was accepted")
	}
}
