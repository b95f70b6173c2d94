package tunnelcore

import (
	"bytes"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/testnet"
)

// TestIdleLaneHoldsNoChunk: a lane reader on a bare TCP socket reads every
// message as it comes, split anyhow, and between messages, while the
// socket has nothing, holds no chunk (an idle agent's lane pinned 256 KiB
// of the node's memory).
func TestIdleLaneHoldsNoChunk(t *testing.T) {
	client, conn := testnet.TCPPair(t)
	l := laneReader{r: conn, raw: readyReads(conn)}
	defer l.dropChunk()
	if l.raw == nil {
		t.Fatal("a bare TCP socket is not read when ready")
	}
	big := bytes.Repeat([]byte("x"), 3*laneChunk)
	wire := laneBytes([]byte("hello"), big, []byte("again"))
	go func() {
		for len(wire) > 0 { // the first header split, the rest whole
			n := min(len(wire), 3+len(wire)/2)
			client.Write(wire[:n])
			wire = wire[n:]
		}
	}()
	for _, want := range [][]byte{[]byte("hello"), big, []byte("again")} {
		msg, err := l.next()
		if err != nil {
			t.Fatal(err)
		}
		if got := msg.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("read %d bytes, want %d", len(got), len(want))
		}
		msg.Free()
	}
	// Nothing more comes: the read waits without a chunk until its
	// deadline.
	conn.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := l.next(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("idle next: %v, want the deadline", err)
	}
	if l.chunk != nil {
		t.Error("an idle lane reader holds its chunk")
	}
	client.Close()
	conn.SetReadDeadline(time.Time{})
	if _, err := l.next(); err == nil {
		t.Error("no error at the end of the stream")
	}
}
