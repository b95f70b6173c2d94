package tunnelcore

import (
	"bytes"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestTinyFramesToAStalledReaderHoldWhatTheyCarry: a peer fills a
// connection's window with one-byte DATA frames while the reader reads
// nothing. The bytes are gathered into a few chunks instead of one queue
// entry (and one transport buffer) per byte, and the reader then gets them
// in order, with a bulk frame in the middle kept in its place.
func TestTinyFramesToAStalledReaderHoldWhatTheyCarry(t *testing.T) {
	node, c, b := nodeWithRawPeer(t, 64, Config{})

	const tiny = InitialWindow / 2
	bulk := bytes.Repeat([]byte{0xbb}, smallPayload)
	var want []byte
	for i := 0; i < tiny; i++ {
		if i == tiny/2 {
			sendPayload(t, b, c.ID(), bulk)
			want = append(want, bulk...)
		}
		p := []byte{byte(i)}
		sendPayload(t, b, c.ID(), p)
		want = append(want, p...)
	}
	eventually(t, 5*time.Second, "every frame buffered", func() bool { return c.Buffered() == len(want) })

	c.mu.Lock()
	entries := c.rq.len()
	c.mu.Unlock()
	// tiny bytes in 16 KiB chunks, the bulk frame and the chunk sealed in
	// front of it.
	if limit := tiny/openChunkSize + 3; entries > limit {
		t.Fatalf("%d bytes in %d tiny frames are %d queue entries, want at most %d", len(want), tiny, entries, limit)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the reader got the bytes out of order or altered")
	}
	if err := node.Err(); err != nil {
		t.Fatalf("session failed: %v", err)
	}
}

// TestSmallPayloadDoesNotPinItsTransportBuffer: a one-byte payload sliced
// out of a 16 KiB transport buffer, as gRPC hands over a small message read
// with others, releases that buffer once received; a bulk payload is kept
// by reference until it is read.
func TestSmallPayloadDoesNotPinItsTransportBuffer(t *testing.T) {
	node, _ := sessionPair(t, transports[0], Config{}, Config{})
	c, _ := node.Open(ConnectInfo{})

	pool := &countingPool{}
	frame := pool.buffer(16 << 10)
	small := frame.Slice(100, 101)
	frame.Free() // the transport's own reference, as gRPC drops it
	c.onData(mem.BufferSlice{small})
	if n := pool.put.Load(); n != 1 {
		t.Fatalf("the 16 KiB buffer behind a buffered 1-byte payload went back to its pool %d times, want 1", n)
	}

	big := pool.buffer(32 << 10)
	c.onData(mem.BufferSlice{big})
	if n := pool.put.Load(); n != 1 {
		t.Fatalf("a buffered bulk payload was released (%d puts) before it was read", n)
	}
	got := make([]byte, 1+32<<10)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if n := pool.put.Load(); n != 2 {
		t.Fatalf("after reading, %d buffers went back to the pool, want 2", n)
	}
}

func sendPayload(t *testing.T, fs FrameStream, id uint64, p []byte) {
	t.Helper()
	if err := fs.Send(&tunnelpb.Envelope{ConnID: id, Payload: mem.BufferSlice{mem.SliceBuffer(p)}}); err != nil {
		t.Fatal(err)
	}
}

// countingPool is a mem.BufferPool that counts the buffers given back.
type countingPool struct{ put atomic.Int64 }

func (p *countingPool) buffer(n int) mem.Buffer {
	b := make([]byte, n)
	return mem.NewBuffer(&b, p)
}

func (p *countingPool) Get(n int) *[]byte {
	b := make([]byte, n)
	return &b
}

func (p *countingPool) Put(*[]byte) { p.put.Add(1) }

// TestTrickledWritesQueueBoundedFrames: a writer sending a byte at a time,
// by Write or through ReadFrom from a source that yields a byte per read,
// while the peer reads nothing: each one-byte frame counts as the buffer it
// holds against SendQueue, so the connection queues a few dozen frames, not
// a frame per byte of credit, and each holds a small buffer, not the 256 KiB
// one ReadFrom read into. Once the peer reads, every byte arrives in order.
func TestTrickledWritesQueueBoundedFrames(t *testing.T) {
	for _, viaReadFrom := range []bool{false, true} {
		name := map[bool]string{false: "Write", true: "ReadFrom"}[viaReadFrom]
		t.Run(name, func(t *testing.T) {
			node, c, b := nodeWithRawPeer(t, 1, Config{})

			const total = 4096 // well within the initial credit
			src := &byteAtATime{left: total}
			done := make(chan error, 1)
			go func() {
				if viaReadFrom {
					_, err := c.ReadFrom(src)
					done <- err
					return
				}
				var err error
				for err == nil && src.left > 0 {
					var p [1]byte
					src.Read(p[:])
					_, err = c.Write(p[:])
				}
				done <- err
			}()

			limit := node.cfg.SendQueue/minFrameCharge + 1
			eventually(t, 5*time.Second, "the writer blocked on a full queue", func() bool {
				return c.queued.Load() >= int64(node.cfg.SendQueue)
			})
			node.sender.mu.Lock()
			frames := c.sq.len()
			var held int
			for _, env := range c.sq.items[c.sq.head:] {
				for _, buf := range env.Payload {
					held += cap(buf.ReadOnlyData())
				}
			}
			node.sender.mu.Unlock()
			if frames > limit {
				t.Fatalf("%d one-byte frames queued, want at most %d", frames, limit)
			}
			if held > 2*node.cfg.SendQueue {
				t.Fatalf("the queued frames hold %d bytes of buffers, SendQueue is %d", held, node.cfg.SendQueue)
			}

			var got []byte
			for len(got) < total {
				env := &tunnelpb.Envelope{}
				if err := b.Recv(env); err != nil {
					t.Fatal(err)
				}
				if env.IsData() {
					got = append(got, env.Payload.Materialize()...)
					env.Payload.Free()
				}
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			for i, v := range got {
				if v != byte(i) {
					t.Fatalf("byte %d is %d, want %d", i, v, byte(i))
				}
			}
		})
	}
}

// byteAtATime yields the bytes 0, 1, 2, ... one per Read, then io.EOF.
type byteAtATime struct{ next, left int }

func (r *byteAtATime) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	p[0] = byte(r.next)
	r.next++
	r.left--
	return 1, nil
}

// TestFragmentedBulkPayloadIsGathered: a payload above smallPayload that
// arrives in thousands of pieces (the peer sent it as one-byte HTTP/2
// frames, each a transport buffer of its own) is gathered like small ones,
// not kept as a queue entry per piece.
func TestFragmentedBulkPayloadIsGathered(t *testing.T) {
	node, _ := sessionPair(t, transports[0], Config{}, Config{})
	c, _ := node.Open(ConnectInfo{})
	var want []byte
	for k := 0; k < InitialWindow/smallPayload; k++ {
		payload := make(mem.BufferSlice, 0, smallPayload)
		for i := 0; i < smallPayload; i++ {
			payload = append(payload, mem.SliceBuffer{byte(k + i)})
			want = append(want, byte(k+i))
		}
		c.onData(payload)
	}
	c.mu.Lock()
	entries := c.rq.len()
	c.mu.Unlock()
	if limit := InitialWindow/openChunkSize + 1; entries > limit {
		t.Fatalf("%d bytes in one-byte pieces are %d queue entries, want at most %d", len(want), entries, limit)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the reader got the bytes out of order or altered")
	}
}

// TestOddCreditFramesAreChargedTheirBuffers: a peer granting 4 KiB + 1 at a
// time while it reads nothing makes frames one byte past a pool tier, each
// held in a 16 KiB buffer; they count as that buffer, so what the queue
// holds stays within SendQueue and one frame's charge.
func TestOddCreditFramesAreChargedTheirBuffers(t *testing.T) {
	node, c, b := nodeWithRawPeer(t, 1, Config{StallTimeout: -1})
	written := make(chan error, 1)
	go func() {
		_, err := c.Write(make([]byte, 4<<20))
		written <- err
	}()
	credit := func() int64 { c.mu.Lock(); defer c.mu.Unlock(); return c.credit }
	eventually(t, 5*time.Second, "the initial credit spent", func() bool { return credit() == 0 })

	const odd = minFrameCharge + 1
	peer := rawPeer{t, b}
	for i := 0; i < 1000 && c.queued.Load() < int64(node.cfg.SendQueue); i++ {
		peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), Increment: odd}}})
		eventually(t, 5*time.Second, "the grant spent or the queue full", func() bool {
			return credit() == 0 || c.queued.Load() >= int64(node.cfg.SendQueue)
		})
	}
	node.sender.mu.Lock()
	var held int
	for _, env := range c.sq.items[c.sq.head:] {
		for _, buf := range env.Payload {
			held += cap(buf.ReadOnlyData())
		}
	}
	node.sender.mu.Unlock()
	if limit := node.cfg.SendQueue + int(frameCharge(odd)); held > limit {
		t.Fatalf("the queued frames hold %d bytes of buffers, want at most %d (SendQueue %d)", held, limit, node.cfg.SendQueue)
	}
	c.Close()
	<-written
}

// TestQueueChargeStaysWithinSendQueue: with a MaxFrameSize between pool
// tiers (300 KiB, held in a 1 MiB buffer), frames are cut to what fits the
// queue allowance instead of one frame holding three times SendQueue.
func TestQueueChargeStaysWithinSendQueue(t *testing.T) {
	node, c, b := nodeWithRawPeer(t, 1, Config{MaxFrameSize: 300 << 10, StallTimeout: -1})
	rawPeer{t, b}.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.ID(), Increment: 8 << 20}}})
	written := make(chan error, 1)
	go func() {
		_, err := c.Write(make([]byte, 8<<20))
		written <- err
	}()
	// queued only grows while the sender is stuck, so any reading past
	// the limit shows the overshoot.
	limit := int64(node.cfg.SendQueue + minFrameCharge)
	eventually(t, 5*time.Second, "the queue filled with the sender stuck", func() bool {
		if q := c.queued.Load(); q > limit {
			t.Fatalf("queue charged %d bytes, SendQueue %d", q, node.cfg.SendQueue)
		}
		return c.queued.Load() > int64(node.cfg.SendQueue)-minFrameCharge && node.sender.sendingSince.Load() != 0
	})
	c.Close()
	<-written
}

// nodeWithRawPeer starts a node session (cfg, its Role set) on a pipe of
// depth frames per direction whose other end the test drives by hand, and
// opens one connection on it.
func nodeWithRawPeer(t *testing.T, depth int, cfg Config) (*Session, *Conn, FrameStream) {
	t.Helper()
	a, b := Pipe(depth)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	cfg.Role = RoleNode
	node, err := NewSession(a, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Close() })
	c, _ := node.Open(ConnectInfo{})
	return node, c, b
}
