package tunnelcore

import (
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestRelaySteadySlowReaderIsNotCut: an upstream that reads steadily (16
// KiB/s, 2 KiB every 125 ms, small socket buffers) but takes longer than the
// linger for the write batch taken before the peer's close. What its socket
// acknowledges counts as progress, so the delivery completes.
func TestRelaySteadySlowReaderIsNotCut(t *testing.T) {
	const linger = 2 * time.Second
	// A small receive buffer from the handshake on (set on the listener),
	// so that the window stays small and the reader's pace shows in
	// what the socket acknowledges.
	lc := &net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		return serr
	}}
	read := make(chan int64, 1)
	up := serveOnce(t, lc, func(c net.Conn) {
		buf := make([]byte, 2048)
		var n int64
		for {
			m, err := io.ReadFull(c, buf)
			n += int64(m)
			if err != nil {
				read <- n
				return
			}
			time.Sleep(125 * time.Millisecond) // the upstream's pace
		}
	})
	up.SetWriteBuffer(4096)
	r := relayTo(t, transports[0], up, lingering(linger))
	const total = 64 << 10
	if _, err := r.nc.Write(make([]byte, total)); err != nil {
		t.Fatal(err)
	}
	r.nc.Close()
	select {
	case res := <-r.result:
		if n := <-read; res.Err != nil || n != total {
			t.Fatalf("relay result %v after the upstream read %d of %d bytes steadily", res.Err, n, total)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the delivery did not end")
	}
}
