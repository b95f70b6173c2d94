package tunnelcore

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// gatedStream holds every Send until open is closed: a stream whose peer
// stopped reading (its gRPC window, or its socket, full).
type gatedStream struct {
	FrameStream
	open chan struct{}
	done chan struct{}
	once sync.Once
}

func (g *gatedStream) wait() error {
	select {
	case <-g.open:
		return nil
	case <-g.done:
		return ErrPipeClosed
	}
}

func (g *gatedStream) Send(e *tunnelpb.Envelope) error {
	if err := g.wait(); err != nil {
		e.Payload.Free()
		return err
	}
	return g.FrameStream.Send(e)
}

func (g *gatedStream) Close(err error) {
	g.once.Do(func() { close(g.done) })
	g.FrameStream.Close(err)
}

// gatedBatch keeps a batching stream's Flush (the lane's) behind the gate.
type gatedBatch struct {
	*gatedStream
	b batchingStream
}

func (g gatedBatch) Flush() error {
	if err := g.wait(); err != nil {
		return err
	}
	return g.b.Flush()
}

func (g gatedBatch) Holding() bool { return g.b.Holding() }

// gated wraps the node's side of tr in a gate, closed at first.
func gated(tr transport) (transport, chan struct{}) {
	open := make(chan struct{})
	return transport{tr.name, func(t testing.TB) (FrameStream, FrameStream) {
		n, a := tr.pair(t)
		g := &gatedStream{FrameStream: n, open: open, done: make(chan struct{})}
		if b, ok := n.(batchingStream); ok {
			return gatedBatch{g, b}, a
		}
		return g, a
	}}, open
}

// TestFlowSendQueueDropsNewest: while the stream takes nothing, a flow's
// writes return at once; its send queue keeps the oldest datagrams that
// fit and drops (and counts) each newer one, and once the stream moves the
// kept ones arrive in order.
func TestFlowSendQueueDropsNewest(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		gtr, open := gated(tr)
		const size, queue = 1000, 100 * (1000 + datagramOverhead)
		var counts Counters
		node, agent := sessionPair(t, gtr, Config{DatagramQueue: queue, Counters: &counts}, Config{})
		nf, err := node.Open(ConnectInfo{RouteKey: "dns", Datagram: true})
		if err != nil {
			t.Fatal(err)
		}
		defer nf.Close()
		const n = 1000
		start := time.Now()
		kept := 0
		for i := range n {
			switch err := nf.WriteDatagram(datagram(i, size)); {
			case err == nil:
				if kept != i {
					t.Fatalf("datagram %d kept after %d was dropped: the newest must go", i, kept)
				}
				kept++
			case !errors.Is(err, ErrDatagramDropped):
				t.Fatalf("datagram %d: %v", i, err)
			}
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("%d writes to a stalled stream took %v: a write waited", n, took)
		}
		if kept != 100 {
			t.Errorf("kept %d datagrams, want the 100 the queue holds", kept)
		}
		if s := nf.FlowStats(); s.DroppedSendQueue != int64(n-kept) || counts.Flows.DroppedSendQueue.Load() != int64(n-kept) {
			t.Errorf("stats %+v, counters %d; want %d dropped", s, counts.Flows.DroppedSendQueue.Load(), n-kept)
		}
		close(open)
		af := accept(t, agent)
		defer af.Close()
		buf := make([]byte, 2*size)
		for i := range kept {
			if m, err := af.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:m], datagram(i, size)) {
				t.Fatalf("datagram %d: %d bytes, %v", i, m, err)
			}
		}
	})
}

// TestFlowRecvQueueDropsNewest: a flow whose reader stopped keeps the
// oldest datagrams its receive queue holds and drops (and counts) the
// newer ones; the session and a connection beside it go on, and the
// reader then finds the kept ones in order.
func TestFlowRecvQueueDropsNewest(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		const size, queue, n = 1000, 100 * (1000 + datagramOverhead), 500
		var counts Counters
		node, agent, nf, af := flowPair(t, tr, Config{DatagramQueue: 1 << 20}, Config{DatagramQueue: queue, Counters: &counts})
		for i := range n {
			if err := nf.WriteDatagram(datagram(i, size)); err != nil {
				t.Fatalf("datagram %d: %v", i, err)
			}
		}
		eventually(t, 10*time.Second, "every datagram queued or dropped", func() bool {
			s := af.FlowStats()
			return s.Received+s.DroppedRecvQueue == n
		})
		if s := af.FlowStats(); s.Received != 100 || counts.Flows.DroppedRecvQueue.Load() != n-100 {
			t.Errorf("stats %+v, counted %d; want 100 kept, %d dropped", s, counts.Flows.DroppedRecvQueue.Load(), n-100)
		}
		echoOnce(t, node, agent)
		buf := make([]byte, 2*size)
		for i := range 100 {
			if m, err := af.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:m], datagram(i, size)) {
				t.Fatalf("datagram %d: %d bytes, %v", i, m, err)
			}
		}
		// Room again: the next datagram is kept.
		if err := nf.WriteDatagram(datagram(n, size)); err != nil {
			t.Fatal(err)
		}
		if m, err := af.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:m], datagram(n, size)) {
			t.Fatalf("datagram after the drain: %d bytes, %v", m, err)
		}
	})
}

// echoOnce opens a connection from node, writes to agent's side and reads
// it back: the session still carries connections.
func echoOnce(t *testing.T, node, agent *Session) {
	t.Helper()
	c, err := node.Open(ConnectInfo{RouteKey: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ac := accept(t, agent)
	defer ac.Close()
	go func() { io.Copy(ac, ac) }()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo: %q %v", buf, err)
	}
}

// TestFlowStalledReaderDoesNotSlowConnections is the head-of-line test: a
// flow whose reader stopped is flooded while a connection of the same
// session downloads; the flood is dropped (counted) at the flow's queue,
// the writer of the flood never waits, and the download runs at a good
// share of its speed alone (the flood's datagrams take their turns in the
// sender and CPU on both ends: the bound is loose, the test runs on two
// cores with the race detector).
func TestFlowStalledReaderDoesNotSlowConnections(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		const size = 64 << 20
		alone := timedDownload(t, tr, size, false)
		flooded := timedDownload(t, tr, size, true)
		t.Logf("%s: 64 MiB alone %v, beside a flooded stalled flow %v", tr.name, alone.took, flooded.took)
		if flooded.dropped == 0 {
			t.Error("the flood dropped nothing at the stalled flow")
		}
		if flooded.maxWrite > time.Second {
			t.Errorf("a datagram write waited %v", flooded.maxWrite)
		}
		if flooded.took > 3*alone.took+time.Second {
			t.Errorf("the download took %v beside the flood, %v alone", flooded.took, alone.took)
		}
	})
}

type downloadResult struct {
	took, maxWrite time.Duration
	dropped        int64
}

// timedDownload times a size-byte transfer from the agent to the node on a
// connection; with flood, a flow whose node-side reader never reads is
// flooded by the agent meanwhile.
func timedDownload(t *testing.T, tr transport, size int, flood bool) downloadResult {
	t.Helper()
	node, agent := sessionPair(t, tr, Config{}, Config{})
	var res downloadResult
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var nf *Conn
	if flood {
		var af *Conn
		nf, af = openFlow(t, node, agent)
		wg.Add(1)
		go func() {
			defer wg.Done()
			floodFlow(af, stop, &res.maxWrite)
		}()
	}
	c, err := node.Open(ConnectInfo{RouteKey: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ac := accept(t, agent)
	defer ac.Close()
	start := time.Now()
	go func() {
		ac.Write(make([]byte, size))
		ac.CloseWrite()
	}()
	n, err := io.Copy(io.Discard, c)
	res.took = time.Since(start)
	close(stop)
	wg.Wait()
	if err != nil || n != int64(size) {
		t.Fatalf("download: %d bytes, %v", n, err)
	}
	if nf != nil {
		res.dropped = nf.FlowStats().DroppedRecvQueue
	}
	return res
}

// floodFlow writes 8000-byte datagrams on f, 5 a millisecond (40 MB/s,
// which fills a stalled flow's queue in a few milliseconds and then only
// drops) until stop, and records the longest write. It is paced as a
// socket's reads would pace it: a writer spinning on WriteDatagram, or
// tens of thousands of small datagrams a second, would measure the CPU
// they take from the download on the test's two cores, not whether the
// flow holds it up.
func floodFlow(f *Conn, stop <-chan struct{}, maxWrite *time.Duration) {
	p := make([]byte, 8000)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		for range 5 {
			start := time.Now()
			f.WriteDatagram(p)
			*maxWrite = max(*maxWrite, time.Since(start))
		}
	}
}

// TestFlowsDoNotWaitOnConnectionCredit: a connection whose reader stopped
// (its writer out of credit) holds up no flow of the session, either way.
func TestFlowsDoNotWaitOnConnectionCredit(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		c, err := node.Open(ConnectInfo{RouteKey: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		ac := accept(t, agent)
		defer ac.Close()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		go func() {
			c.SetWriteDeadline(time.Now().Add(time.Minute))
			for ctx.Err() == nil {
				if _, err := c.Write(make([]byte, 1<<20)); err != nil {
					return
				}
			}
		}()
		eventually(t, 5*time.Second, "the connection's writer to run out of credit", func() bool {
			return ac.Buffered() >= InitialWindow
		})
		nf, af := openFlow(t, node, agent)
		buf := make([]byte, 100)
		for i := range 100 {
			if err := nf.WriteDatagram(datagram(i, 50)); err != nil {
				t.Fatal(err)
			}
			if n, err := af.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:n], datagram(i, 50)) {
				t.Fatalf("node→agent datagram %d: %v", i, err)
			}
			if err := af.WriteDatagram(datagram(i, 60)); err != nil {
				t.Fatal(err)
			}
			if n, err := nf.ReadDatagram(buf); err != nil || !bytes.Equal(buf[:n], datagram(i, 60)) {
				t.Fatalf("agent→node datagram %d: %v", i, err)
			}
		}
	})
}
