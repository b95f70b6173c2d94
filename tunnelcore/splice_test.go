//go:build linux

package tunnelcore

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestRelayFromASocketKeepsEveryByte: an agent relaying a TCP upstream
// that writes in pieces of every size delivers the same bytes over every
// transport; on the plaintext lane the bulk of them is spliced.
func TestRelayFromASocketKeepsEveryByte(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		const size = 24 << 20
		want := make([]byte, size)
		rng := rand.New(rand.NewPCG(1, 2))
		for i := range want {
			want[i] = byte(rng.Uint32())
		}
		upstream, agentSide := tcpPair(t)
		go func() {
			// Small writes first (the connection starts on the copying
			// path), then pieces up to 1 MiB.
			rest := want
			for len(rest) > 0 {
				n := min(len(rest), 1+rng.IntN(1<<20))
				if len(want)-len(rest) < 64<<10 {
					n = min(len(rest), 1+rng.IntN(4<<10))
				}
				if _, err := upstream.Write(rest[:n]); err != nil {
					return
				}
				rest = rest[n:]
			}
			upstream.CloseWrite()
		}()

		c, err := node.Open(ConnectInfo{})
		if err != nil {
			t.Fatal(err)
		}
		ac := accept(t, agent)
		relayed := make(chan RelayResult, 1)
		go func() { relayed <- Relay(agentSide, ac) }()
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != size || sha256.Sum256(got) != sha256.Sum256(want) {
			t.Fatalf("received %d bytes, not the %d sent (or not the same ones)", len(got), size)
		}
		select {
		case res := <-relayed:
			if res.Err != nil || res.AToB != size {
				t.Fatalf("relay: %+v", res)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the relay did not end")
		}
		spliced := agent.Stats().Spliced
		if tr.name == "lane" && spliced < size/2 {
			t.Fatalf("spliced %d of %d bytes over a plaintext lane", spliced, size)
		}
		if tr.name != "lane" && spliced != 0 {
			t.Fatalf("spliced %d bytes over %s", spliced, tr.name)
		}
	})
}

// TestRelayCopiesWhenNoPipeIsLeft: with every pipe of the process taken, a
// bulk relay onto a plaintext lane copies instead, and loses nothing.
func TestRelayCopiesWhenNoPipeIsLeft(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	if agent.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}
	var taken []*kernelPipe
	defer func() {
		for _, p := range taken {
			pipes.put(p, true)
		}
	}()
	for p := pipes.get(); p != nil; p = pipes.get() {
		taken = append(taken, p)
	}
	want := bytes.Repeat([]byte{7}, 4<<20)
	if got := download(t, node, agent, func(up *net.TCPConn) { up.Write(want) }); !bytes.Equal(got, want) {
		t.Fatalf("received %d of %d bytes", len(got), len(want))
	}
	if s := agent.Stats().Spliced; s != 0 {
		t.Fatalf("spliced %d bytes with no pipe to be had", s)
	}
}

// TestSplicedPayloadAfterCloseWriteIsRefused: a payload moved into a pipe
// before a concurrent CloseWrite is refused, as a Write's would be, and
// gives its queue charge back.
func TestSplicedPayloadAfterCloseWriteIsRefused(t *testing.T) {
	node, _ := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	w, r := tcpPair(t)
	if _, err := w.Write([]byte("late")); err != nil {
		t.Fatal(err)
	}
	raw, err := r.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.reserve(4)
	if err != nil {
		t.Fatal(err)
	}
	p, m, err := fillPipe(raw, n)
	if err != nil {
		t.Skipf("no splicing here: %v", err)
	}
	defer pipes.put(p, false)
	c.unreserve(int64(n), int64(m))
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if node.sendSpliced(c, &splicedFrame{pipe: p, n: m, done: make(chan error, 1)}) {
		t.Fatal("a spliced payload was queued after CloseWrite")
	}
	if q := c.queued.Load(); q != 0 {
		t.Fatalf("the refused payload still charges %d bytes", q)
	}
}

// gatedLane is a lane whose Send of one connection's DATA waits for the
// test, holding the session's sender.
type gatedLane struct {
	LaneStream
	conn    atomic.Uint64
	entered chan struct{}
	gate    chan struct{}
}

func (g *gatedLane) Send(e *tunnelpb.Envelope) error {
	if e.IsData() && e.ConnID == g.conn.Load() {
		g.entered <- struct{}{}
		<-g.gate
	}
	return g.LaneStream.Send(e)
}

// TestSplicedFramesTakeTheirTurn: a spliced payload is written by the
// session's sender in its connection's turn, not by the relaying
// goroutine: while the sender is stuck on another connection's frame,
// nothing is spliced, and everything arrives once it moves on.
func TestSplicedFramesTakeTheirTurn(t *testing.T) {
	client, server := tcpPair(t)
	lane := &gatedLane{LaneStream: ConnStream(server), entered: make(chan struct{}, 1), gate: make(chan struct{})}
	// Room for several frames in front of the stuck sender.
	node, agent := sessionPair(t, streams(lane, ConnStream(client)), Config{SendQueue: 4 << 20, StallTimeout: -1}, Config{})
	if node.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}

	a, _ := node.Open(ConnectInfo{})
	lane.conn.Store(a.ID())
	if _, err := a.Write([]byte("stuck")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-lane.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the sender never reached a's frame")
	}

	const size = InitialWindow // b's credit: all of it fits one frame
	upstream, nodeSide := tcpPair(t)
	if _, err := upstream.Write(bytes.Repeat([]byte{9}, size)); err != nil {
		t.Fatal(err)
	}
	upstream.CloseWrite()
	raw, err := nodeSide.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := node.Open(ConnectInfo{})
	before := pipesInUse()
	spliced := make(chan error, 1)
	go func() {
		_, err := b.spliceFrom(raw)
		spliced <- err
	}()
	eventually(t, 5*time.Second, "b's payload waiting in a pipe", func() bool { return pipesInUse() > before })
	if s := node.Stats().Spliced; s != 0 {
		t.Fatalf("%d bytes spliced while the sender was stuck", s)
	}

	close(lane.gate)
	ac := accept(t, agent)
	bc := accept(t, agent)
	if bc.ID() != b.ID() {
		ac, bc = bc, ac
	}
	bc.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, size)
	if _, err := io.ReadFull(bc, got); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{9}, size)) {
		t.Fatalf("b's bytes did not arrive whole: %v", err)
	}
	select {
	case err := <-spliced:
		if err != io.EOF {
			t.Fatalf("spliceFrom ended with %v, want io.EOF", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("spliceFrom did not end at the socket's end")
	}
	if s := node.Stats().Spliced; s != size {
		t.Fatalf("spliced %d bytes, want %d", s, size)
	}
	if got := make([]byte, 5); func() error { _, err := io.ReadFull(ac, got); return err }() != nil || string(got) != "stuck" {
		t.Fatalf("a's bytes: %q", got)
	}
}

// TestUrgentDataDoesNotStopASplicedRelay: splice(2) stops at TCP urgent
// data where read(2) steps over it; a spliced relay from a socket that
// sends some delivers everything else, as the copying path does, instead
// of stalling and then ending early.
func TestUrgentDataDoesNotStopASplicedRelay(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	const half = 1 << 20
	got := download(t, node, agent, func(up *net.TCPConn) {
		up.Write(bytes.Repeat([]byte{1}, half))
		if raw, err := up.SyscallConn(); err == nil {
			raw.Write(func(fd uintptr) bool {
				syscall.Sendto(int(fd), []byte{'!'}, syscall.MSG_OOB, nil)
				return true
			})
		}
		up.Write(bytes.Repeat([]byte{2}, half))
	})
	want := append(bytes.Repeat([]byte{1}, half), bytes.Repeat([]byte{2}, half)...)
	if !bytes.Equal(got, want) {
		t.Fatalf("received %d of %d bytes", len(got), len(want))
	}
}

// streams is a transport of two given streams, the node's and the agent's.
func streams(node, agent FrameStream) transport {
	return transport{"given", func(t testing.TB) (FrameStream, FrameStream) {
		t.Cleanup(func() { node.Close(nil); agent.Close(nil) })
		return node, agent
	}}
}

// relayedConn opens a connection from the node whose agent end is relayed to
// socket agentSide, and gives its reads a deadline.
func relayedConn(t *testing.T, node, agent *Session, agentSide *net.TCPConn) *Conn {
	t.Helper()
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	go Relay(agentSide, accept(t, agent))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	return c
}

// pipesInUse is how many pipes the process's pool has handed out.
func pipesInUse() int {
	pipes.mu.Lock()
	defer pipes.mu.Unlock()
	return pipes.inUse
}

// download relays a TCP upstream, which write drives before it
// half-closes, from the agent to a connection the node opened, and returns
// what the node read to the end.
func download(t *testing.T, node, agent *Session, write func(up *net.TCPConn)) []byte {
	t.Helper()
	upstream, agentSide := tcpPair(t)
	go func() {
		write(upstream)
		upstream.CloseWrite()
	}()
	c := relayedConn(t, node, agent, agentSide)
	c.CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("after %d bytes: %v", len(got), err)
	}
	return got
}

// TestIdleSplicingConnectionHoldsNoPipe: a connection that moved bulk
// through a pipe gives it back while its socket is idle, so idle
// keep-alive upstream connections do not use up the pool.
func TestIdleSplicingConnectionHoldsNoPipe(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	if agent.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}
	before := pipesInUse()
	const size = 4 << 20
	upstream, agentSide := tcpPair(t)
	go upstream.Write(bytes.Repeat([]byte{3}, size)) // and then stays open, idle
	c := relayedConn(t, node, agent, agentSide)
	if _, err := io.ReadFull(c, make([]byte, size)); err != nil {
		t.Fatal(err)
	}
	if agent.Stats().Spliced == 0 {
		t.Fatal("nothing was spliced")
	}
	eventually(t, 5*time.Second, "the pipe given back", func() bool { return pipesInUse() == before })
}

// TestPipePoolIsBounded: past maxPipes there is no pipe (the connection
// copies), and of those given back only maxIdlePipes stay open.
func TestPipePoolIsBounded(t *testing.T) {
	var pool pipePool
	var got []*kernelPipe
	defer func() {
		for _, p := range got {
			p.close()
		}
	}()
	for range maxPipes {
		p := pool.get()
		if p == nil {
			t.Skipf("the system gave only %d pipes", len(got))
		}
		got = append(got, p)
	}
	if p := pool.get(); p != nil {
		p.close()
		t.Fatalf("got pipe %d, over maxPipes", maxPipes+1)
	}
	for i, p := range got {
		pool.put(p, i%2 == 0) // every other one may still hold bytes
	}
	if len(pool.idle) != maxIdlePipes || pool.inUse != 0 {
		t.Fatalf("idle %d, in use %d after all came back; want %d, 0", len(pool.idle), pool.inUse, maxIdlePipes)
	}
	for i, p := range got {
		kept := slices.Contains(pool.idle, p)
		if kept && (i%2 != 0 || p.r < 0) {
			t.Fatalf("pipe %d kept although it may hold bytes, or closed", i)
		}
		if !kept && p.r >= 0 {
			t.Fatalf("pipe %d neither kept nor closed", i)
		}
	}
}

// TestSplicedRelayPassesAResetOn: an upstream that resets its connection
// in the middle of a spliced download reaches the far end as an error,
// not as a clean end, as on the copying path (TestRelayPassesAResetOn).
func TestSplicedRelayPassesAResetOn(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	if agent.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}
	const half = 2 << 20
	upstream, agentSide := tcpPair(t)
	halfRead := make(chan struct{})
	go func() {
		upstream.Write(make([]byte, half))
		select {
		case <-halfRead:
		case <-time.After(10 * time.Second):
		}
		upstream.Write(make([]byte, half))
		upstream.SetLinger(0)
		upstream.Close() // RST
	}()
	c := relayedConn(t, node, agent, agentSide)
	if _, err := io.ReadFull(c, make([]byte, half)); err != nil {
		t.Fatal(err)
	}
	if agent.Stats().Spliced == 0 {
		t.Fatal("the first half was not spliced")
	}
	close(halfRead)
	n, err := io.Copy(io.Discard, c)
	var perr *PeerError
	if !errors.As(err, &perr) {
		t.Fatalf("after %d more bytes the read ended with %v, want the peer's abort", n, err)
	}
}

// failingLane is a lane whose spliced writes fail, as a lane reset in the
// middle of one would.
type failingLane struct{ LaneStream }

func (failingLane) sendSpliced(uint64, *kernelPipe, int) error {
	return errors.New("lane reset mid-splice")
}

// TestFailedSpliceIsTheSessionsEnd: a spliced write that fails ends the
// session, and the relay reading the upstream reports that end (so both
// sides are cut), not a connection closed as if the stream were whole.
func TestFailedSpliceIsTheSessionsEnd(t *testing.T) {
	client, server := tcpPair(t)
	node, agent := sessionPair(t, streams(ConnStream(server), failingLane{ConnStream(client)}), Config{}, Config{})
	if agent.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, c) // grant credit
	ac := accept(t, agent)
	upstream, agentSide := tcpPair(t)
	go upstream.Write(make([]byte, 4<<20))
	agentSide.SetReadDeadline(time.Now().Add(10 * time.Second)) // a hang fails, not stalls, the test
	n, err := ac.ReadFrom(agentSide)
	if !errors.Is(err, ErrSessionClosed) {
		t.Fatalf("ReadFrom after %d bytes: %v; want the session's end", n, err)
	}
	c.Close()
}
