package tunnelcore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"testing/iotest"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// laneBytes frames msgs as the lane does: 0, a 4-byte length, the bytes.
func laneBytes(msgs ...[]byte) []byte {
	var out []byte
	for _, m := range msgs {
		out = append(out, 0)
		out = binary.BigEndian.AppendUint32(out, uint32(len(m)))
		out = append(out, m...)
	}
	return out
}

// readAll reads messages until an error and returns them with the error.
func readAll(r io.Reader) ([][]byte, error) {
	l := laneReader{r: r}
	defer l.dropChunk()
	var got [][]byte
	for {
		msg, err := l.next()
		if err != nil {
			return got, err
		}
		got = append(got, msg.Materialize())
		msg.Free()
	}
}

// randomReads returns at most a random number of bytes per Read, so
// messages and headers split at every kind of place.
type randomReads struct {
	r   io.Reader
	rng *rand.Rand
}

func (r randomReads) Read(p []byte) (int, error) {
	n := 1 + r.rng.IntN(len(p))
	if r.rng.IntN(4) == 0 {
		n = min(n, 7)
	}
	return r.r.Read(p[:n])
}

func TestLaneReaderSplitsMessagesAnyHowTheBytesArrive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var msgs [][]byte
	// Sizes around the chunk's edges and far beyond it, and empty ones.
	for _, n := range []int{0, 1, 5, 100, laneChunk - 5, laneChunk, laneChunk + 1, 3 * laneChunk, 17, 0, minLaneRead, 1 << 20} {
		m := make([]byte, n)
		for i := range m {
			m[i] = byte(rng.Uint32())
		}
		msgs = append(msgs, m)
	}
	for i := 0; i < 200; i++ {
		m := make([]byte, rng.IntN(40<<10))
		for j := range m {
			m[j] = byte(i + j)
		}
		msgs = append(msgs, m)
	}
	stream := laneBytes(msgs...)
	readers := map[string]io.Reader{
		"whole":   bytes.NewReader(stream),
		"onebyte": iotest.OneByteReader(bytes.NewReader(stream)),
		"random":  randomReads{bytes.NewReader(stream), rng},
	}
	for name, r := range readers {
		got, err := readAll(r)
		if err != io.EOF {
			t.Fatalf("%s: ended with %v, want io.EOF", name, err)
		}
		if len(got) != len(msgs) {
			t.Fatalf("%s: %d messages, want %d", name, len(got), len(msgs))
		}
		for i := range msgs {
			if !bytes.Equal(got[i], msgs[i]) {
				t.Fatalf("%s: message %d (%d bytes) differs", name, i, len(msgs[i]))
			}
		}
	}
}

func TestLaneReaderRefusesBrokenStreams(t *testing.T) {
	whole := laneBytes([]byte("hello"), []byte("world"))
	tooLarge := []byte{0, 0xff, 0xff, 0xff, 0xff}
	cases := []struct {
		name  string
		bytes []byte
		want  error
	}{
		{"cut inside a header", whole[:len(whole)-8], io.ErrUnexpectedEOF},
		{"cut inside a payload", whole[:len(whole)-2], io.ErrUnexpectedEOF},
		{"length over the limit", tooLarge, ErrLaneMessageTooLarge},
		{"compressed", []byte{1, 0, 0, 0, 1, 'x'}, ErrLaneCompressed},
	}
	for _, tc := range cases {
		_, err := readAll(bytes.NewReader(tc.bytes))
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
}

// halfClosing closes a lane as the node does: its session's end only
// half-closes it; the owner closes it once the peer closed its end.
type halfClosing struct{ LaneStream }

func (h halfClosing) Close(error) { h.CloseWrite() }

// TestHalfClosedLaneDeliversTheLastFrames: a node whose agent keeps sending
// what the node no longer reads flushes a last frame (the answer to a
// Drain) and ends the session. Closing the socket with bytes unread would
// reset the connection and could discard that frame before the agent read
// it; the node half-closes instead, keeps reading until the agent closed
// its end, and only then closes.
func TestHalfClosedLaneDeliversTheLastFrames(t *testing.T) {
	for i := range 10 {
		a, b := lanePair(t)
		lane := a.(LaneStream)
		got := make(chan *tunnelpb.Frame, 1)
		node, err := NewSession(halfClosing{lane}, Config{Role: RoleNode})
		if err != nil {
			t.Fatal(err)
		}
		agent, err := NewSession(b, Config{Role: RoleAgent, OnControl: func(f *tunnelpb.Frame) { got <- f }})
		if err != nil {
			t.Fatal(err)
		}
		ac, err := agent.Open(ConnectInfo{})
		if err != nil {
			t.Fatal(err)
		}
		go ac.Write(make([]byte, 4*InitialWindow)) // the node never reads it
		node.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: &tunnelpb.AdvertiseAck{NodeId: "n1"}}})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := node.Flush(ctx); err != nil {
			t.Fatalf("round %d: Flush: %v", i, err)
		}
		cancel()
		node.CloseWithError(errors.New("left"))
		select {
		case f := <-got:
			if f.GetAdvertiseAck().GetNodeId() != "n1" {
				t.Fatalf("round %d: got %v", i, f)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the agent never got the last frame (%v)", i, agent.Err())
		}
		agent.Close() // the agent, having read everything, closes its end
		select {
		case <-lane.RecvEnded():
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the node's receive loop never saw the agent close", i)
		}
		lane.Close(nil)
	}
}

// referenceLane splits b as the lane's framing says, plainly: the messages
// before the first problem, and the problem (io.EOF for a clean end).
func referenceLane(b []byte) ([][]byte, error) {
	var msgs [][]byte
	for {
		if len(b) == 0 {
			return msgs, io.EOF
		}
		if len(b) < 5 {
			return msgs, io.ErrUnexpectedEOF
		}
		if b[0] != 0 {
			return msgs, ErrLaneCompressed
		}
		n := int(binary.BigEndian.Uint32(b[1:5]))
		if n > maxLaneMessage {
			return msgs, ErrLaneMessageTooLarge
		}
		if len(b) < 5+n {
			return msgs, io.ErrUnexpectedEOF
		}
		msgs = append(msgs, b[5:5+n])
		b = b[5+n:]
	}
}

// FuzzLaneReader: whatever bytes a peer sends on a lane, and however they
// arrive, laneReader returns the messages the framing says and then the
// same error as a plain reading of it.
func FuzzLaneReader(f *testing.F) {
	f.Add(laneBytes([]byte("hello"), nil, []byte("world")), uint64(1))
	f.Add([]byte{0, 0, 0, 0}, uint64(2))
	f.Add([]byte{1, 0, 0, 0, 0}, uint64(3))
	f.Add([]byte{0, 0xff, 0xff, 0xff, 0xff}, uint64(4))
	f.Add(laneBytes(make([]byte, 70000), []byte{1}), uint64(5))
	f.Fuzz(func(t *testing.T, b []byte, seed uint64) {
		want, wantErr := referenceLane(b)
		got, err := readAll(randomReads{bytes.NewReader(b), rand.New(rand.NewPCG(seed, seed))})
		if !errors.Is(err, wantErr) {
			t.Fatalf("ended with %v, want %v", err, wantErr)
		}
		if len(got) != len(want) {
			t.Fatalf("%d messages, want %d", len(got), len(want))
		}
		for i := range want {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("message %d differs", i)
			}
		}
	})
}

// TestPlaintextLaneWritesTheSocket: a plaintext lane marked with its own
// socket keeps the bare socket, so frames leave with writev, not through
// the copying buffer a TLS lane needs.
func TestPlaintextLaneWritesTheSocket(t *testing.T) {
	a, b := net.Pipe() // stand-ins: only the types matter
	defer a.Close()
	defer b.Close()
	tcp := &net.TCPConn{}
	if got := OverSocket(tcp, tcp); got != net.Conn(tcp) {
		t.Fatalf("OverSocket(raw, raw) wrapped the socket: %T", got)
	}
	if s := ConnStream(tcp).(*connStream); s.bw != nil {
		t.Fatal("a bare TCP lane writes through a buffer")
	}
	if s := ConnStream(OverSocket(a, tcp)).(*connStream); s.bw == nil {
		t.Fatal("a lane over another conn (TLS) writes unbuffered")
	}
}

// trickle hands out its bytes a few KiB per Read and records, for each
// Read, how large a buffer it was given against how much it had delivered.
type trickle struct {
	data      []byte
	delivered int
	worst     float64 // the largest len(p) / max(delivered, laneChunk) seen
}

func (r *trickle) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	r.worst = max(r.worst, float64(len(p))/float64(max(r.delivered, laneChunk)))
	n := copy(p[:min(len(p), 4<<10)], r.data)
	r.data = r.data[n:]
	r.delivered += n
	return n, nil
}

// TestLaneReaderTakesMemoryAsBytesArrive: a message announced long is read
// into buffers taken as its bytes come, not all at once: a peer sending a
// 4 MiB length prefix and then little or nothing holds the lane's chunk
// (which every lane holds) and a few times what it sent, not 4 MiB.
func TestLaneReaderTakesMemoryAsBytesArrive(t *testing.T) {
	payload := make([]byte, maxLaneMessage)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	r := &trickle{data: laneBytes(payload)}
	got, err := readAll(r)
	if err != io.EOF || len(got) != 1 || !bytes.Equal(got[0], payload) {
		t.Fatalf("read %d messages (%v); want the 4 MiB message whole", len(got), err)
	}
	if r.worst > 3 {
		t.Fatalf("a read was given a buffer %.1f times what had arrived", r.worst)
	}
}
