package tunnelcore

import (
	"errors"
	"io"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func TestStallWatchdogCutsAPeerThatStopsReading(t *testing.T) {
	a, b := Pipe(1)
	t.Cleanup(func() { a.Close(nil) })
	node, err := NewSession(a, Config{Role: RoleNode, StallTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// The peer answers nothing and reads nothing: the pipe fills and Send
	// blocks, as gRPC's would with a peer that stopped reading the stream.
	_ = b
	c, _ := node.Open(ConnectInfo{})
	go c.Write(make([]byte, 1<<20))
	for i := 0; i < 3; i++ {
		other, _ := node.Open(ConnectInfo{})
		go other.Write(make([]byte, 1<<20))
	}
	waitStalled(t, node, 5*time.Second)
	if _, err := c.Write([]byte("x")); !errors.Is(err, ErrSessionClosed) {
		t.Fatalf("conn after stall: %v", err)
	}
}

func TestStallWatchdogSparesASlowReader(t *testing.T) {
	a, b := Pipe(2)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	node, _ := NewSession(a, Config{Role: RoleNode, StallTimeout: 500 * time.Millisecond})
	defer node.Close()
	stop := make(chan struct{})
	defer close(stop)
	// A raw peer that takes one frame every 50 ms and grants credit back:
	// the Connect frame and twenty 1 KiB DATA frames, each taken slowly.
	const frames = 21
	took := slowPeer(b, 50*time.Millisecond, frames, stop)
	c, _ := node.Open(ConnectInfo{})
	go func() {
		buf := make([]byte, 1024)
		for i := 0; i < frames-1; i++ {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	select {
	case n := <-took:
		if n != frames {
			t.Fatalf("the peer took %d frames of %d: %v", n, frames, node.Err())
		}
	case <-node.Done():
		t.Fatalf("slow but steady reader was cut: %v", node.Err())
	case <-time.After(10 * time.Second):
		t.Fatal("the slow reader did not finish")
	}
	if node.Err() != nil {
		t.Fatalf("session failed: %v", node.Err())
	}
}

func TestSlotsBoundOpen(t *testing.T) {
	slots := NewSlots(3)
	node, agent := sessionPair(t, transports[0], Config{Slots: slots}, Config{})
	for round := 0; round < 100; round++ {
		var conns []*Conn
		for i := 0; i < 3; i++ {
			c, err := node.Open(ConnectInfo{})
			if err != nil {
				t.Fatalf("round %d open %d: %v", round, i, err)
			}
			conns = append(conns, c)
		}
		if _, err := node.Open(ConnectInfo{}); !errors.Is(err, ErrConnLimit) {
			t.Fatalf("round %d: open past the limit: %v", round, err)
		}
		for _, c := range conns {
			accept(t, agent).Close()
			c.Close()
		}
		// The slots come back once the connections ended: no leak.
		eventually(t, 5*time.Second, "slots released", func() bool { return slots.InUse() == 0 })
	}
}

func TestSlotsBoundAccept(t *testing.T) {
	agentSlots := NewSlots(1)
	node, agent := sessionPair(t, transports[0], Config{}, Config{Slots: agentSlots})
	var conns []*Conn
	for i := 0; i < 3; i++ {
		c, _ := node.Open(ConnectInfo{})
		conns = append(conns, c)
	}
	ac := accept(t, agent)
	var refused int
	for _, c := range conns[1:] {
		_, err := c.Read(make([]byte, 1))
		var pe *PeerError
		if errors.As(err, &pe) && pe.Code == tunnelpb.Error_RESOURCE_EXHAUSTED {
			refused++
		}
	}
	if refused != 2 || ac.ID() != conns[0].ID() {
		t.Fatalf("%d connections refused by the agent, want 2", refused)
	}
	for _, c := range conns {
		c.Close()
	}
	ac.Close()
	eventually(t, 5*time.Second, "agent slot released", func() bool { return agentSlots.InUse() == 0 })
}

func TestIdleReaderWindowIsReclaimed(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		budget := NewBudget(8 << 20)
		node, agent := sessionPair(t, tr, Config{}, Config{Budget: budget, ReclaimAfter: 100 * time.Millisecond})
		c, _ := node.Open(ConnectInfo{})
		go func() {
			buf := make([]byte, 64<<10)
			for i := 0; i < 256; i++ { // 16 MiB
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
			c.CloseWrite()
		}()
		ac := accept(t, agent)
		// Read until the window has grown (it may shrink again later, so
		// stop while it is grown), at most 8 MiB.
		var read int64
		for read < 8<<20 && (read < 1<<20 || budget.InUse() == 0) {
			n, err := io.CopyN(io.Discard, ac, 64<<10)
			read += n
			if err != nil {
				t.Fatal(err)
			}
		}
		if budget.InUse() == 0 {
			t.Fatal("window never grew; the test proves nothing")
		}
		grown := budget.InUse()
		// The reader stops: what is charged beyond what it holds comes back.
		eventually(t, 5*time.Second, "budget released by reclaim", func() bool {
			held := int64(ac.Buffered()) - InitialWindow
			return budget.InUse() <= max(held, 0)
		})
		t.Logf("budget %d while reading, %d after reclaim (buffered %d)", grown, budget.InUse(), ac.Buffered())
		// Reading again still delivers everything.
		n, err := io.Copy(io.Discard, ac)
		if err != nil || read+n != 16<<20 {
			t.Fatalf("after reclaim read %d (%d before), %v", n, read, err)
		}
		c.Close()
		ac.Close()
	})
}
