package tunnelcore

import (
	"bytes"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// endRecorder is a Config.OnConnEnd that keeps what it is told and
// counts reports of a connection it was told about already.
type endRecorder struct {
	ch   chan ConnEnd
	mu   sync.Mutex
	seen map[uint64]int
}

func newEndRecorder() *endRecorder {
	return &endRecorder{ch: make(chan ConnEnd, 64), seen: make(map[uint64]int)}
}

func (r *endRecorder) hook(e ConnEnd) {
	r.mu.Lock()
	r.seen[e.ID]++
	r.mu.Unlock()
	r.ch <- e
}

// next waits for the next report.
func (r *endRecorder) next(t *testing.T) ConnEnd {
	t.Helper()
	select {
	case e := <-r.ch:
		return e
	case <-time.After(5 * time.Second):
		t.Fatal("no ConnEnd reported")
		return ConnEnd{}
	}
}

// once fails the test if a connection was reported more than once.
func (r *endRecorder) once(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, n := range r.seen {
		if n != 1 {
			t.Errorf("connection %d reported %d times", id, n)
		}
	}
}

func endPair(t *testing.T, tr transport) (node, agent *Session, nodeEnds, agentEnds *endRecorder) {
	nodeEnds, agentEnds = newEndRecorder(), newEndRecorder()
	node, agent = sessionPair(t, tr, Config{OnConnEnd: nodeEnds.hook}, Config{OnConnEnd: agentEnds.hook})
	return node, agent, nodeEnds, agentEnds
}

func checkEnd(t *testing.T, side string, e ConnEnd, want ConnOutcome, openedHere bool, read, written int64) {
	t.Helper()
	if e.Outcome != want || e.OpenedHere != openedHere || e.Read != read || e.Written != written {
		t.Errorf("%s: got %v openedHere=%v read=%d written=%d (err %v), want %v openedHere=%v read=%d written=%d",
			side, e.Outcome, e.OpenedHere, e.Read, e.Written, e.Err, want, openedHere, read, written)
	}
	if e.Opened.IsZero() || e.Duration <= 0 || e.Opened.After(time.Now()) {
		t.Errorf("%s: opened %v, lived %v", side, e.Opened, e.Duration)
	}
}

// TestConnEndCleanClose: both ends report a connection closed after each
// half-closed, with what it carried and what its opener announced.
func TestConnEndCleanClose(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent, nodeEnds, agentEnds := endPair(t, tr)
		info := ConnectInfo{RouteKey: "r", RemoteAddr: "203.0.113.7:4000", ServerName: "sni.example", Tag: "pooled"}
		nc, err := node.Open(info)
		if err != nil {
			t.Fatal(err)
		}
		nc.Write([]byte("hello"))
		nc.CloseWrite()
		ac := accept(t, agent)
		if got, err := io.ReadAll(ac); err != nil || string(got) != "hello" {
			t.Fatalf("agent read %q, %v", got, err)
		}
		ac.Write([]byte("world!"))
		ac.CloseWrite()
		if got, err := io.ReadAll(nc); err != nil || string(got) != "world!" {
			t.Fatalf("node read %q, %v", got, err)
		}
		nc.Close()
		ac.Close()

		n := nodeEnds.next(t)
		checkEnd(t, "node", n, ConnClosed, true, 6, 5)
		if n.Err != nil || n.Direct || n.ID != nc.ID() || n.Info != info {
			t.Errorf("node: err %v direct %v id %d info %+v", n.Err, n.Direct, n.ID, n.Info)
		}
		a := agentEnds.next(t)
		checkEnd(t, "agent", a, ConnClosed, false, 5, 6)
		if want := (ConnectInfo{RouteKey: "r", RemoteAddr: "203.0.113.7:4000", ServerName: "sni.example"}); a.Info != want {
			t.Errorf("agent info %+v, want %+v", a.Info, want)
		}
		nodeEnds.once(t)
		agentEnds.once(t)
	})
}

// TestConnEndPeerAbort: the end that aborts reports ConnAborted, its peer
// ConnPeerAborted with the peer's error, before it closes its side; its
// Close reports nothing more.
func TestConnEndPeerAbort(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent, nodeEnds, agentEnds := endPair(t, tr)
		nc, ac := openAccepted(t, node, agent)
		nc.Abort(tunnelpb.Error_RESET, "client went away")
		a := agentEnds.next(t)
		checkEnd(t, "agent", a, ConnPeerAborted, false, 1, 0)
		var perr *PeerError
		if !errors.As(a.Err, &perr) || perr.Code != tunnelpb.Error_RESET {
			t.Errorf("agent err %v, want the peer's RESET", a.Err)
		}
		ac.Close()
		n := nodeEnds.next(t)
		checkEnd(t, "node", n, ConnAborted, true, 0, 1)
		if !errors.Is(n.Err, ErrConnClosed) {
			t.Errorf("node err %v", n.Err)
		}
		node.Close()
		nodeEnds.once(t)
		agentEnds.once(t)
	})
}

// TestConnEndSessionEnd: connections still open when the session ends are
// reported on both ends as ended with it.
func TestConnEndSessionEnd(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent, nodeEnds, agentEnds := endPair(t, tr)
		openAccepted(t, node, agent)
		openAccepted(t, node, agent)
		node.Close()
		for _, r := range []*endRecorder{nodeEnds, agentEnds} {
			for range 2 {
				e := r.next(t)
				if e.Outcome != ConnSessionEnded || !errors.Is(e.Err, ErrSessionClosed) {
					t.Errorf("got %v (%v), want %v", e.Outcome, e.Err, ConnSessionEnded)
				}
			}
			r.once(t)
		}
	})
}

// TestConnEndRefused: a connection the peer refuses is reported refused on
// the end that opened it.
func TestConnEndRefused(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent, nodeEnds, agentEnds := endPair(t, tr)
		nc, err := node.Open(ConnectInfo{RouteKey: "r"})
		if err != nil {
			t.Fatal(err)
		}
		nc.Write([]byte("x"))
		ac := accept(t, agent)
		ac.Abort(tunnelpb.Error_DIAL_FAILED, "upstream down")
		if _, err := io.ReadAll(nc); err == nil {
			t.Fatal("read succeeded on a refused connection")
		}
		nc.Close()
		n := nodeEnds.next(t)
		checkEnd(t, "node", n, ConnRefused, true, 0, 1)
		a := agentEnds.next(t)
		checkEnd(t, "agent", a, ConnAborted, false, 0, 0)
	})
}

// TestConnEndDirect: a connection that moved to a direct socket reports
// so, with the bytes it carried there counted.
func TestConnEndDirect(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		nodeEnds, agentEnds := newEndRecorder(), newEndRecorder()
		node, agent := directPairWith(t, tr, 64<<10, directOpts{nodeEnd: nodeEnds.hook, agentEnd: agentEnds.hook})
		nc, ac := openAccepted(t, node, agent)
		first := bytes.Repeat([]byte("d"), 512<<10)
		go ac.Write(first)
		if _, err := io.ReadFull(nc, make([]byte, len(first))); err != nil {
			t.Fatal(err)
		}
		eventually(t, 5*time.Second, "both ends direct", func() bool { return nc.Direct() && ac.Direct() })
		rest := bytes.Repeat([]byte("e"), 256<<10)
		go sendAll(ac, rest, 64<<10)
		if got, err := io.ReadAll(nc); err != nil || len(got) != len(rest) {
			t.Fatalf("read %d bytes after the move, %v", len(got), err)
		}
		nc.Close()
		ac.Close()
		total := int64(len(first) + len(rest))
		n := nodeEnds.next(t)
		checkEnd(t, "node", n, ConnClosed, true, total, 1)
		a := agentEnds.next(t)
		checkEnd(t, "agent", a, ConnClosed, false, 1, total)
		if !n.Direct || !a.Direct {
			t.Errorf("direct: node %v agent %v", n.Direct, a.Direct)
		}
		nodeEnds.once(t)
		agentEnds.once(t)
	})
}
