//go:build linux

package tunnelcore

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"
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
	const size = 4 << 20
	upstream, agentSide := tcpPair(t)
	go func() {
		upstream.Write(bytes.Repeat([]byte{7}, size))
		upstream.CloseWrite()
	}()
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	ac := accept(t, agent)
	go Relay(agentSide, ac)
	c.CloseWrite()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || len(got) != size || !bytes.Equal(got, bytes.Repeat([]byte{7}, size)) {
		t.Fatalf("received %d of %d bytes: %v", len(got), size, err)
	}
	if s := agent.Stats().Spliced; s != 0 {
		t.Fatalf("spliced %d bytes with no pipe to be had", s)
	}
}

// filledPipe returns a pipe holding payload, moved in from a socket, with
// its bytes reserved on c as ReadFrom would have.
func filledPipe(t *testing.T, c *Conn, payload []byte) (*kernelPipe, int) {
	t.Helper()
	p, err := newKernelPipe(pipeSize)
	if err != nil {
		t.Skipf("no pipe: %v", err)
	}
	t.Cleanup(p.close)
	w, r := tcpPair(t)
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	raw, err := r.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.reserve(len(payload))
	if err != nil || n != len(payload) {
		t.Fatalf("reserve: %d, %v", n, err)
	}
	held := 0
	for held < n { // one splice may take part of what the socket has
		m, err := p.fill(raw, n-held)
		if err != nil {
			t.Fatal(err)
		}
		held += m
	}
	return p, n
}

// TestSpliceBehindQueuedFramesWaitsItsTurn: a payload to splice for a
// connection whose earlier frames (its Connect, a Write) are still queued
// is queued behind them instead, so the peer reads the bytes in order.
func TestSpliceBehindQueuedFramesWaitsItsTurn(t *testing.T) {
	node, agent := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	if node.sender.splice == nil {
		t.Skip("the lane cannot splice here")
	}
	// Hold the stream as a splice in progress would: what follows queues.
	node.sender.streamMu.Lock()
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	first := []byte("first, written before the splice")
	if _, err := c.Write(first); err != nil {
		t.Fatal(err)
	}
	second := bytes.Repeat([]byte("second "), 8000) // within one queue allowance
	p, n := filledPipe(t, c, second)
	emptied, err := node.spliceHeld(c, p, n)
	if err != nil || !emptied {
		t.Fatalf("spliceHeld: emptied %v, %v", emptied, err)
	}
	c.CloseWrite()
	got, err := io.ReadAll(accept(t, agent))
	if err != nil {
		t.Fatal(err)
	}
	if want := append(append([]byte{}, first...), second...); !bytes.Equal(got, want) {
		t.Fatalf("received %d bytes, not the %d written in order", len(got), len(want))
	}
	if s := node.Stats().Spliced; s != 0 {
		t.Fatalf("spliced %d bytes that had to wait", s)
	}
}

// TestSpliceAfterCloseWriteIsRefused: a payload a writer moved into its
// pipe before a concurrent CloseWrite is refused, as a Write's would be,
// and the pipe, still full, is not to be reused.
func TestSpliceAfterCloseWriteIsRefused(t *testing.T) {
	node, _ := sessionPair(t, transport{"lane", lanePair}, Config{}, Config{})
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	p, n := filledPipe(t, c, []byte("late"))
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	emptied, err := node.sendSpliced(c, p, n)
	if !errors.Is(err, ErrWriteClosed) || emptied {
		t.Fatalf("sendSpliced after CloseWrite: emptied %v, %v; want ErrWriteClosed", emptied, err)
	}
	if q := c.queued.Load(); q != 0 {
		t.Fatalf("the refused payload still charges %d bytes", q)
	}
}

// TestPipePoolIsBounded: past maxPipes there is no pipe (the connection
// copies), and of those given back only maxIdlePipes stay open.
func TestPipePoolIsBounded(t *testing.T) {
	var pool pipePool
	var got []*kernelPipe
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
	for _, p := range got {
		pool.put(p, true)
	}
	if len(pool.idle) != maxIdlePipes || pool.inUse != 0 {
		t.Fatalf("idle %d, in use %d after all came back; want %d, 0", len(pool.idle), pool.inUse, maxIdlePipes)
	}
	closed := got[len(got)-1] // given back past maxIdlePipes: closed
	if _, err := syscall.Write(closed.w, []byte{0}); err == nil {
		t.Fatal("a pipe given back past maxIdlePipes is still open")
	}
	for _, p := range pool.idle {
		p.close()
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
	c, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	ac := accept(t, agent)
	go Relay(agentSide, ac)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
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
