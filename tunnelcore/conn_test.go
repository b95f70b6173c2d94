package tunnelcore

import (
	"errors"
	"io"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// wireRecorder is a FrameStream that notes, per connection, DATA frames
// sent after the connection's Close frame (a protocol violation: the peer
// fails the connection and drops what it had buffered). Send blocks while
// the recorder is paused.
type wireRecorder struct {
	FrameStream
	mu           sync.Mutex
	gate         chan struct{} // closed: open
	finSent      map[uint64]bool
	dataAfterFIN map[uint64]int
}

func newWireRecorder(fs FrameStream) *wireRecorder {
	w := &wireRecorder{FrameStream: fs, gate: make(chan struct{}), finSent: map[uint64]bool{}, dataAfterFIN: map[uint64]int{}}
	close(w.gate)
	return w
}

func (w *wireRecorder) pause()  { w.mu.Lock(); w.gate = make(chan struct{}); w.mu.Unlock() }
func (w *wireRecorder) resume() { w.mu.Lock(); close(w.gate); w.mu.Unlock() }

func (w *wireRecorder) Send(e *tunnelpb.Envelope) error {
	w.mu.Lock()
	gate := w.gate
	w.mu.Unlock()
	<-gate
	w.mu.Lock()
	if e.IsData() {
		if w.finSent[e.ConnID] {
			w.dataAfterFIN[e.ConnID]++
		}
	} else if cl := e.Frame.GetClose(); cl != nil {
		w.finSent[cl.GetConnId()] = true
	}
	w.mu.Unlock()
	return w.FrameStream.Send(e)
}

func (w *wireRecorder) lateData(id uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dataAfterFIN[id]
}

// heldReader signals when Read is entered (ReadFrom has reserved credit by
// then) and returns its payload once released.
type heldReader struct {
	entered, release chan struct{}
	payload          []byte
	done             bool
}

func (r *heldReader) Read(p []byte) (int, error) {
	if r.done {
		return 0, io.EOF
	}
	r.done = true
	close(r.entered)
	<-r.release
	return copy(p, r.payload), nil
}

// recordedPair is a node and an agent session over a pipe whose node side
// records the frames it sends; both close at the end of the test.
func recordedPair(t *testing.T) (node, agent *Session, rec *wireRecorder) {
	t.Helper()
	a, b := pipePair(t)
	rec = newWireRecorder(a)
	node, err := NewSession(rec, Config{Role: RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Close() })
	agent, err = NewSession(b, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close() })
	return node, agent, rec
}

// TestDataAfterCloseIsNotSent: a ReadFrom that reserved credit, then waited
// on its source while the connection was closed, must not queue its DATA
// behind the FIN: the peer would fail the connection and drop the bytes
// written before Close.
func TestDataAfterCloseIsNotSent(t *testing.T) {
	node, agent, rec := recordedPair(t)

	nc, _ := node.Open(ConnectInfo{})
	other, _ := node.Open(ConnectInfo{})
	if _, err := nc.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	ac := accept(t, agent)
	oc := accept(t, agent)
	eventually(t, 2*time.Second, "hello buffered at the agent", func() bool { return ac.Buffered() == 5 })

	// The sender is busy with another connection's frame, so the FIN
	// stays queued while the late DATA comes.
	rec.pause()
	other.Write([]byte("x"))
	eventually(t, 2*time.Second, "sender blocked", func() bool { return node.sender.sendingSince.Load() != 0 })

	r := &heldReader{entered: make(chan struct{}), release: make(chan struct{}), payload: []byte("world")}
	rf := make(chan error, 1)
	go func() { _, err := nc.ReadFrom(r); rf <- err }()
	<-r.entered // credit reserved; the source (a TCP read) blocks
	nc.Close()
	close(r.release)
	err := <-rf
	rec.resume()
	if !errors.Is(err, ErrConnClosed) {
		t.Fatalf("ReadFrom across Close returned %v, want ErrConnClosed", err)
	}
	other.Close()
	oc.Close()
	// Once out of the table, every frame it queued has left the sender.
	eventually(t, 2*time.Second, "closed conns out of the node's table", func() bool { return node.NumConns() == 0 })
	if n := rec.lateData(nc.ID()); n != 0 {
		t.Fatalf("%d DATA frames sent after the connection's Close", n)
	}
	ac.SetReadDeadline(time.Now().Add(2 * time.Second))
	got, err := io.ReadAll(ac)
	if string(got) != "hello" || err != nil {
		t.Fatalf("agent read %q, %v; want \"hello\" then EOF", got, err)
	}
	ac.Close()
	if s := node.Stats(); s.Queued != 0 {
		t.Fatalf("node still counts %d queued bytes", s.Queued)
	}
}

// TestWriteRacingCloseDeliversWhatItReported: a Write racing Close either
// queues its bytes in front of the FIN or fails; the peer reads exactly
// what Write reported, then EOF, and no DATA follows the FIN.
func TestWriteRacingCloseDeliversWhatItReported(t *testing.T) {
	node, agent, rec := recordedPair(t)

	chunk := make([]byte, 1024)
	for i := 0; i < 200; i++ {
		nc, _ := node.Open(ConnectInfo{})
		ac := accept(t, agent)
		read := make(chan int, 1)
		go func() {
			ac.SetReadDeadline(time.Now().Add(5 * time.Second))
			got, err := io.ReadAll(ac)
			if err != nil {
				t.Errorf("iteration %d: agent read: %v", i, err)
			}
			read <- len(got)
		}()
		wrote := make(chan int, 1)
		started := make(chan struct{})
		go func() {
			total := 0
			for j := 0; ; j++ {
				if j == 1 {
					close(started)
				}
				n, err := nc.Write(chunk)
				total += n
				if err != nil {
					if j == 0 {
						close(started)
					}
					break
				}
			}
			wrote <- total
		}()
		<-started
		nc.Close()
		w := <-wrote
		if r := <-read; r != w {
			t.Fatalf("iteration %d: Write reported %d bytes, the peer read %d", i, w, r)
		}
		ac.Close()
		if n := rec.lateData(nc.ID()); n != 0 {
			t.Fatalf("iteration %d: %d DATA frames sent after Close", i, n)
		}
	}
}

// TestDataAfterPeerCloseReadsAsError: the bytes dropped when the peer sends
// DATA after its FIN must not read as a clean (truncated) stream.
func TestDataAfterPeerCloseReadsAsError(t *testing.T) {
	a, b := pipePair(t)
	agent, err := NewSession(a, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	peer := rawPeer{t, b}
	peer.send(connectFrame(2, InitialWindow))
	peer.data(2, 5)
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: 2}}})
	peer.data(2, 1)
	if e := peer.nextControl().GetError(); e.GetConnId() != 2 || e.GetCode() != tunnelpb.Error_PROTOCOL {
		t.Fatalf("peer got %v, want Error PROTOCOL for conn 2", e)
	}
	c := accept(t, agent)
	got, err := io.ReadAll(c)
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_PROTOCOL {
		t.Fatalf("read %d bytes then %v, want a PROTOCOL error", len(got), err)
	}
}

// heldWriter blocks its first Write until released.
type heldWriter struct {
	entered, release chan struct{}
	once             bool
}

func (w *heldWriter) Write(p []byte) (int, error) {
	if !w.once {
		w.once = true
		close(w.entered)
		<-w.release
	}
	return len(p), nil
}

// TestBufferedStaysZeroWhenClosedDuringWriteTo: Close drops the buffer,
// including the batch WriteTo is writing; finishing that batch must not
// take its bytes off the counts a second time.
func TestBufferedStaysZeroWhenClosedDuringWriteTo(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	nc, _ := node.Open(ConnectInfo{})
	nc.Write(make([]byte, 1000))
	ac := accept(t, agent)
	eventually(t, 2*time.Second, "data buffered", func() bool { return ac.Buffered() == 1000 })
	w := &heldWriter{entered: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error, 1)
	go func() { _, err := ac.WriteTo(w); done <- err }()
	<-w.entered
	ac.Close()
	close(w.release)
	if err := <-done; !errors.Is(err, ErrConnClosed) {
		t.Fatalf("WriteTo returned %v, want ErrConnClosed", err)
	}
	if b, cb := agent.Stats().Buffered, ac.Buffered(); b != 0 || cb != 0 {
		t.Fatalf("after Close: session Buffered %d, conn Buffered %d, want 0", b, cb)
	}
	if read, _ := ac.Counts(); read != 1000 {
		t.Fatalf("Counts read %d, want the 1000 bytes WriteTo wrote", read)
	}
	nc.Close()
}

// TestCloseEndsEveryWaitingReadAndWrite: net.Conn allows concurrent Reads
// and Writes; Close ends all of those waiting (for data, for credit), not
// only the first one woken.
func TestCloseEndsEveryWaitingReadAndWrite(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		node, agent := sessionPair(t, transports[0], Config{}, Config{})
		nc, err := node.Open(ConnectInfo{RouteKey: "r"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := nc.Write(make([]byte, InitialWindow)); err != nil { // the whole credit
			t.Fatal(err)
		}
		accept(t, agent) // which neither reads nor writes
		const waiters = 3
		errs := make(chan error, 2*waiters)
		for range waiters {
			go func() { _, err := nc.Write([]byte("more")); errs <- err }()
			go func() { _, err := nc.Read(make([]byte, 8)); errs <- err }()
		}
		synctest.Wait() // every one waits: no credit, nothing to read
		nc.Close()
		for i := range 2 * waiters {
			select {
			case err := <-errs:
				if !errors.Is(err, ErrConnClosed) {
					t.Errorf("call %d ended with %v, want ErrConnClosed", i, err)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("%d of %d waiting calls still wait after Close", 2*waiters-i, 2*waiters)
			}
		}
	})
}
