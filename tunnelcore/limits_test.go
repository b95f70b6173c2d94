package tunnelcore

import (
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

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
	// A stall timeout 20 times the reader's pace (a scheduling hiccup on
	// a loaded machine is no stall), over a run three times as long.
	node, _ := NewSession(a, Config{Role: RoleNode, StallTimeout: time.Second})
	defer node.Close()
	stop := make(chan struct{})
	defer close(stop)
	// A raw peer that takes one frame every 50 ms and grants credit back:
	// the Connect frame and sixty 1 KiB DATA frames, each taken slowly.
	const frames = 61
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

// TestReclaimFloodIsAnsweredOncePerRequestInBoundedMemory: a peer that
// sends reclaim requests without reading holds one control queue entry for
// the connection however many it sends (more than the queue bound, which
// would otherwise stop the session reading), and gets exactly one answer
// per request, the answers releasing the credit above the request once.
func TestReclaimFloodIsAnsweredOncePerRequestInBoundedMemory(t *testing.T) {
	const requests = 2 * controlQueueBound
	node, c, b := nodeWithRawPeer(t, 1, Config{})
	peer := rawPeer{t, b}
	const extra = 1 << 20
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), Increment: extra}}})
	maxQueued := 0
	observe := func() (queued int, owed int64) {
		q := &node.sender
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.ctrl.len(), c.answersOwed
	}
	for i := 0; i < requests; i++ {
		peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), ReclaimAbove: InitialWindow}}})
		maxQueued = max(maxQueued, func() int { n, _ := observe(); return n }())
	}
	// Up to two answers left the queue: one in the pipe, one blocked in
	// Send on the full pipe.
	eventually(t, 5*time.Second, "the requests dispatched", func() bool {
		_, owed := observe()
		return owed >= requests-2
	})
	if n, _ := observe(); maxQueued > 1 || n > 1 {
		t.Fatalf("control queue held up to %d entries (now %d) for one connection's answers", maxQueued, n)
	}
	if err := node.Err(); err != nil {
		t.Fatalf("session failed: %v", err)
	}
	// The peer reads: one answer per request, releasing the extra credit.
	var answers int
	var released int64
	for answers < requests {
		env := &tunnelpb.Envelope{}
		if err := b.Recv(env); err != nil {
			t.Fatal(err)
		}
		u := env.Frame.GetWindowUpdate()
		if u == nil {
			continue // the Connect
		}
		if u.GetIncrement() != 0 || u.GetBlocked() || u.GetReclaimAbove() != 0 {
			t.Fatalf("unexpected window update %v", u)
		}
		answers++
		released += int64(u.GetReleased())
	}
	if released != extra {
		t.Fatalf("answers released %d bytes, want %d", released, extra)
	}
	// Nothing more is owed: a refused Connect is the next frame, not
	// another answer.
	peer.send(connectFrame(2, InitialWindow)) // a node's id: wrong parity
	f := peer.nextFrame()
	if f.GetConnect() != nil { // sent after the answers, which overtook it
		f = peer.nextFrame()
	}
	if e := f.GetError(); e.GetConnId() != 2 || e.GetCode() != tunnelpb.Error_PROTOCOL {
		t.Fatalf("after %d answers the peer got %v, want the refusal", answers, f)
	}
}

// TestRefusalFloodIsPacedByThePeersReading: a peer that sends Connects to be
// refused faster than it reads the refusals is read no further once the
// control queue is full, instead of growing it without end or failing the
// session; once it reads, every Connect gets its refusal and the session
// goes on. The refusals are logged a few at a time, not one line each.
func TestRefusalFloodIsPacedByThePeersReading(t *testing.T) {
	a, b := Pipe(1)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	core, logs := observer.New(zap.WarnLevel)
	agent, err := NewSession(a, Config{Role: RoleAgent, Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	const total = 3 * controlQueueBound
	sent := make(chan int, 1)
	go func() {
		n := 0
		for ; n < total; n++ {
			// Odd ids are the agent's own: every one is refused.
			if b.Send(&tunnelpb.Envelope{Frame: connectFrame(uint64(2*n+1), InitialWindow)}) != nil {
				break
			}
		}
		sent <- n
	}()

	eventually(t, 5*time.Second, "the agent's control queue full", func() bool { return agent.controlQueued() >= controlQueueBound })
	select {
	case n := <-sent:
		t.Fatalf("the peer sent all %d Connects without reading an answer", n)
	default:
	}
	if n := agent.controlQueued(); n > controlQueueBound+1 {
		t.Fatalf("%d control frames queued, bound %d", n, controlQueueBound)
	}

	refusals := 0
	deadline := time.Now().Add(20 * time.Second)
	for refusals < total && time.Now().Before(deadline) {
		env := &tunnelpb.Envelope{}
		if err := b.Recv(env); err != nil {
			t.Fatalf("reading the refusals: %v (after %d)", err, refusals)
		}
		if env.Frame.GetError() != nil {
			refusals++
		}
	}
	if n := <-sent; n != total || refusals != total {
		t.Fatalf("sent %d Connects, read %d refusals, want %d each", n, refusals, total)
	}
	if agent.isDone() {
		t.Fatalf("session ended: %v", agent.Err())
	}
	if n := logs.FilterMessage("tunnel connect refused").Len(); n > 10 {
		t.Fatalf("%d refusal lines logged for %d refusals", n, total)
	}
}

// TestOwnConnectionFramesPastTheBoundStillReadThePeer: control frames of
// this end's own connections (here a grant each, as thousands of busy
// connections queue while the peer's gRPC window is full) do not stop the
// receive loop, as answers to the peer do: two busy ends would otherwise
// each stop reading the other and never drain.
func TestOwnConnectionFramesPastTheBoundStillReadThePeer(t *testing.T) {
	const conns = controlQueueBound + 100
	node, first, b := nodeWithRawPeer(t, 1, Config{})
	first.grant(1)
	for i := 1; i < conns; i++ {
		c, err := node.Open(ConnectInfo{})
		if err != nil {
			t.Fatal(err)
		}
		c.grant(1)
	}
	if n := node.controlQueued(); n < controlQueueBound {
		t.Fatalf("only %d control frames queued", n)
	}

	// The receive loop was already waiting in Recv for the first frame;
	// the second is the one a full queue would hold back.
	peer := rawPeer{t, b}
	peer.data(first.ID(), 100)
	peer.data(first.ID(), 100)
	eventually(t, 5*time.Second, "the peer's DATA read", func() bool { return first.Buffered() == 200 })

	var got int
	for got < conns {
		env := &tunnelpb.Envelope{}
		if err := b.Recv(env); err != nil {
			t.Fatal(err)
		}
		if env.Frame.GetWindowUpdate().GetIncrement() == 1 {
			got++
		}
	}
	if err := node.Err(); err != nil {
		t.Fatalf("session failed: %v", err)
	}
}

// TestGrantsToAPeerThatDoesNotReadShareOneEntry: a peer that never reads
// our frames can still send within the credit it knows we decide (half a
// window at a time, read at once by our reader). Those grants do not pace
// it, so they must not pile up either: however much it pushes, the
// connection holds one grant entry, which carries all of it when the peer
// reads.
func TestGrantsToAPeerThatDoesNotReadShareOneEntry(t *testing.T) {
	node, c, b := nodeWithRawPeer(t, 1, Config{StallTimeout: -1})
	copied := make(chan error, 1)
	go func() { _, err := io.Copy(io.Discard, c); copied <- err }()

	const rounds = 200
	peer := rawPeer{t, b}
	for i := 1; i <= rounds; i++ {
		peer.data(c.ID(), InitialWindow/2)
		eventually(t, 5*time.Second, "the reader took the data", func() bool {
			r, _ := c.Counts()
			return r == int64(i)*InitialWindow/2
		})
	}
	// The Connect may be in the pipe or in a blocked Send; the grants are
	// at most one entry.
	if n := node.controlQueued(); n > 1 {
		t.Fatalf("%d control frames queued after %d grants the peer did not read", n, rounds)
	}

	var granted int64
	for granted < rounds*InitialWindow/2 {
		env := &tunnelpb.Envelope{}
		if err := b.Recv(env); err != nil {
			t.Fatal(err)
		}
		granted += int64(env.Frame.GetWindowUpdate().GetIncrement())
	}
	if granted != rounds*InitialWindow/2 {
		t.Fatalf("granted %d bytes, want %d", granted, rounds*InitialWindow/2)
	}
	c.Close()
	<-copied
}

// controlQueued is how many control frames wait in s's sender.
func (s *Session) controlQueued() int {
	s.sender.mu.Lock()
	defer s.sender.mu.Unlock()
	return s.sender.ctrl.len()
}

// TestReclaimAnswerAfterTheKeptCreditWasSpent: the peer answers a reclaim
// request only after it sent the credit it kept and the reader took it (a
// sluice writer can: a Write may spend the kept credit before the answer is
// queued). The window then shrinks with nothing outstanding, and no byte
// can come to trigger the next grant, so one is sent with the answer's
// processing: the writer is not left with no credit for good.
func TestReclaimAnswerAfterTheKeptCreditWasSpent(t *testing.T) {
	_, c, b := nodeWithRawPeer(t, 64, Config{ReclaimAfter: 20 * time.Millisecond})

	// The peer's side: what it was granted, and the reclaim requests.
	var granted atomic.Int64
	granted.Store(InitialWindow)
	reclaims := make(chan uint32, 4)
	go func() {
		for {
			env := &tunnelpb.Envelope{}
			if b.Recv(env) != nil {
				return
			}
			if u := env.Frame.GetWindowUpdate(); u != nil {
				granted.Add(int64(u.GetIncrement()))
				if u.GetReclaimAbove() > 0 {
					reclaims <- u.GetReclaimAbove()
				}
			}
		}
	}()
	peer := rawPeer{t, b}
	var sent int64
	send := func(n int) {
		peer.data(c.ID(), n)
		sent += int64(n)
	}

	// Grow the window to 512 KiB or more: each round the reader waits
	// first, then the peer says it is blocked and sends half the window
	// (which doubles, or grows fourfold if the test's own delays look like
	// a long round trip).
	windowSize := func() int64 { c.mu.Lock(); defer c.mu.Unlock(); return c.rwin.size }
	for round := 0; windowSize() < 512<<10; round++ {
		if round == 8 {
			t.Fatalf("window still %d bytes after %d rounds", windowSize(), round)
		}
		size := windowSize()
		read := make(chan error, 1)
		go func() { _, err := io.ReadFull(c, make([]byte, size/2)); read <- err }()
		eventually(t, 5*time.Second, "the reader waiting", func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.rwin.readerWaited })
		want := granted.Load()
		peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), Blocked: true}}})
		send(int(size / 2))
		if err := <-read; err != nil {
			t.Fatal(err)
		}
		eventually(t, 5*time.Second, "the grant of the grown window", func() bool { return granted.Load() > want })
	}

	// The reader idles: the node asks for the credit above 64 KiB back.
	var above uint32
	select {
	case above = <-reclaims:
	case <-time.After(5 * time.Second):
		t.Fatal("no reclaim request")
	}
	credit := granted.Load() - sent
	kept := min(credit, int64(above))
	// The peer spends what it kept, the reader takes it, then the answer.
	send(int(kept))
	if _, err := io.ReadFull(c, make([]byte, kept)); err != nil {
		t.Fatal(err)
	}
	before := granted.Load()
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), Released: uint32(credit - kept)}}})
	eventually(t, 5*time.Second, "credit granted after the answer", func() bool { return granted.Load() > before })
}

// TestEndedConnectionHoldsItsSlotUntilItsControlFramesLeft: a connection
// whose peer aborted it while a grant of it waits in the control queue (the
// peer reads nothing) keeps its slot until the grant left. Otherwise a peer
// cycling connections (send half a window, which our reader takes, then
// abort) would leave a grant behind per cycle, which no bound counts.
func TestEndedConnectionHoldsItsSlotUntilItsControlFramesLeft(t *testing.T) {
	slots := NewSlots(1)
	node, c, b := nodeWithRawPeer(t, 1, Config{Slots: slots, StallTimeout: -1})
	// The Connect fills the pipe; a session frame then blocks in Send, so
	// what is queued next stays queued.
	if err := node.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{}}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the sender blocked", func() bool { return node.controlQueued() == 0 && node.sender.sendingSince.Load() != 0 })
	peer := rawPeer{t, b}
	peer.data(c.ID(), InitialWindow/2)
	if _, err := io.ReadFull(c, make([]byte, InitialWindow/2)); err != nil {
		t.Fatal(err)
	}
	if node.controlQueued() != 1 {
		t.Fatalf("%d control frames queued, want the grant", node.controlQueued())
	}
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Error{Error: &tunnelpb.Error{ConnId: c.ID(), Code: tunnelpb.Error_CANCELED}}})
	eventually(t, 5*time.Second, "the abort dispatched", func() bool {
		_, err := c.Read(make([]byte, 1))
		return err != nil
	})
	c.Close()
	if _, err := node.Open(ConnectInfo{}); !errors.Is(err, ErrConnLimit) {
		t.Fatalf("the aborted connection gave its slot back with its grant still queued: open = %v", err)
	}

	// The peer reads: the grant leaves, and the slot comes back.
	go func() {
		for {
			env := &tunnelpb.Envelope{}
			if b.Recv(env) != nil {
				return
			}
			env.Payload.Free()
		}
	}()
	eventually(t, 5*time.Second, "the slot released", func() bool { return slots.InUse() == 0 })
}

// TestPeerAbortGivesTheWindowChargeBack: a connection the peer aborts
// leaves the session at once, and gives back the budget its grown window
// was charged, also while its owner has not closed it yet.
func TestPeerAbortGivesTheWindowChargeBack(t *testing.T) {
	budget := NewBudget(64 << 20)
	node, agent := sessionPair(t, transports[0], Config{}, Config{Budget: budget})
	nc, err := node.Open(ConnectInfo{RouteKey: "r"})
	if err != nil {
		t.Fatal(err)
	}
	ac := accept(t, agent)
	go func() {
		buf := make([]byte, 256<<10)
		for range 64 {
			if _, err := nc.Write(buf); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for i := 0; i < 256 && budget.InUse() == 0; i++ { // a reader keeping up grows the window
		if _, err := ac.Read(buf); err != nil {
			t.Fatal(err)
		}
	}
	if budget.InUse() == 0 {
		t.Fatal("the window never grew: nothing to give back")
	}
	nc.Abort(tunnelpb.Error_RESET, "cut")
	eventually(t, 5*time.Second, "the aborted connection out of the session", func() bool { return agent.NumConns() == 0 })
	eventually(t, 5*time.Second, "the window's charge given back", func() bool { return budget.InUse() == 0 })
	ac.Close()
}
