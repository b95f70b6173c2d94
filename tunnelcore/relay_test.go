package tunnelcore

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestRelayEndsWhenItsConnBreaks: a relay between an upstream that ignores
// the half-close (it reads to EOF and never answers nor closes) and a
// virtual connection ends (closing both) once the virtual
// connection is aborted by the other end or its session ends, instead of
// waiting on the upstream's silence for good.
func TestRelayEndsWhenItsConnBreaks(t *testing.T) {
	for _, how := range []string{"peer abort", "peer close", "session end"} {
		t.Run(how, func(t *testing.T) {
			node, agent := sessionPair(t, transports[0], Config{}, Config{})
			nc, _ := node.Open(ConnectInfo{})
			if _, err := nc.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			ac := accept(t, agent)

			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			testOver := make(chan struct{})
			defer close(testOver)
			halfClosed := make(chan struct{})
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				io.Copy(io.Discard, c) // to the half-close's EOF
				close(halfClosed)
				<-testOver // then silent, and open
			}()
			uc, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			relayed := make(chan RelayResult, 1)
			go func() { relayed <- Relay(uc, ac) }()

			// The other end half-closes (the upstream reads EOF and stays
			// silent), then gives up on the connection.
			nc.CloseWrite()
			select {
			case <-halfClosed:
			case <-time.After(5 * time.Second):
				t.Fatal("the half-close never reached the upstream")
			}
			switch how {
			case "peer abort":
				nc.Abort(tunnelpb.Error_RESET, "client reset")
			case "peer close": // CANCELED: a close, ended normally here
				nc.Close()
			case "session end":
				node.Close()
			}
			select {
			case res := <-relayed:
				// A session's end reads as the connection closed; an abort
				// is an error; a close is not.
				if how == "peer abort" && res.Err == nil {
					t.Error("the relay reported a clean end for an aborted connection")
				}
				if how == "peer close" && res.Err != nil {
					t.Errorf("the relay reported %v for a connection its peer closed", res.Err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the relay still waits on the silent upstream")
			}
		})
	}
}

// TestRelayDeliversWhatAPeerSentBeforeClosing: the peer writes, then
// closes while its read side is open (DATA, FIN, then CANCELED). The relay
// writes every byte to the upstream before it closes it, though the
// upstream only reads once the CANCELED has arrived; closing at the
// CANCELED would end a truncated stream cleanly.
func TestRelayDeliversWhatAPeerSentBeforeClosing(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	nc, err := node.Open(ConnectInfo{})
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte(strings.Repeat("0123456789abcdef", InitialWindow/16))
	if _, err := nc.Write(payload); err != nil {
		t.Fatal(err)
	}
	ac := accept(t, agent)
	up, upstream := net.Pipe() // unbuffered: the relay's writes wait for the upstream
	relayed := make(chan RelayResult, 1)
	go func() { relayed <- Relay(up, ac) }()

	nc.Close()
	eventually(t, 5*time.Second, "the CANCELED reached the agent", ac.isBroken)
	upstream.SetDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(upstream)
	if err != nil {
		t.Fatalf("upstream read: %v", err)
	}
	if string(got) != string(payload) {
		t.Fatalf("the upstream read %d of the %d bytes sent before the close, then EOF", len(got), len(payload))
	}
	select {
	case res := <-relayed:
		if res.Err != nil {
			t.Errorf("the relay reported %v for a connection its peer closed", res.Err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the relay did not end once everything was delivered")
	}
}

// serveOnce listens on loopback (with lc's options; nil for the defaults),
// runs serve on the first connection it accepts, and returns a connection
// dialed to it. Both are closed at cleanup.
func serveOnce(t *testing.T, lc *net.ListenConfig, serve func(net.Conn)) *net.TCPConn {
	t.Helper()
	if lc == nil {
		lc = &net.ListenConfig{}
	}
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		serve(c)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// relayed is a connection the node of a new session pair opened (nc),
// whose agent end (ac) a relay joins to an upstream in the background.
type relayed struct {
	node, agent *Session
	nc, ac      *Conn
	result      chan RelayResult
}

// relayTo opens a connection over tr and relays its agent end to up with
// relay (Relay, or relayWith with a short linger).
func relayTo(t *testing.T, tr transport, up net.Conn, relay func(a, b net.Conn) RelayResult) *relayed {
	t.Helper()
	r := &relayed{result: make(chan RelayResult, 1)}
	r.node, r.agent = sessionPair(t, tr, Config{}, Config{})
	var err error
	if r.nc, err = r.node.Open(ConnectInfo{}); err != nil {
		t.Fatal(err)
	}
	r.ac = accept(t, r.agent)
	go func() { r.result <- relay(up, r.ac) }()
	return r
}

// lingering relays with a linger of d.
func lingering(d time.Duration) func(a, b net.Conn) RelayResult {
	return func(a, b net.Conn) RelayResult { return relayWith(a, b, d) }
}

// smallBuffers gives a TCP connection 4 KiB socket buffers.
func smallBuffers(c net.Conn) {
	c.(*net.TCPConn).SetReadBuffer(4096)
	c.(*net.TCPConn).SetWriteBuffer(4096)
}

// TestRelayAfterPeerCloseNeverHangs: after the peer's close (CANCELED) the
// relay still delivers what it had, but never waits for good on the real
// side. An echo upstream blocked writing answers nobody reads (the closed
// peer reads none) gets them read and dropped, so it reads the rest: every
// byte the client wrote arrives, then EOF, and the relay ends. One that
// reads nothing is given up, both cut and the result an error, when the
// Conn's session ends or after the linger without progress.
func TestRelayAfterPeerCloseNeverHangs(t *testing.T) {
	t.Run("echo upstream", func(t *testing.T) {
		// Small socket buffers, so that what the agent holds for the echo
		// is more than the sockets between them can take.
		echoed := make(chan int64, 1)
		up := serveOnce(t, nil, func(c net.Conn) {
			smallBuffers(c)
			n, err := io.Copy(c, c)
			if err != nil {
				n = -1 // not a clean EOF
			}
			c.Close()
			echoed <- n
		})
		smallBuffers(up)
		r := relayTo(t, transports[0], up, Relay)
		written := make(chan int, 1)
		go func() { // uploads, and never reads the echo
			n, _ := r.nc.Write(make([]byte, 64<<20))
			written <- n
		}()
		// The echo fills the window the client never reads, then its own
		// socket buffers: blocked writing, it stops reading, and what the
		// client sent piles up at the agent.
		eventually(t, 20*time.Second, "the echo to block", func() bool {
			return r.nc.Buffered() >= InitialWindow && r.ac.Buffered() >= InitialWindow
		})
		r.nc.Close()
		sent := <-written
		select {
		case res := <-r.result:
			if res.Err != nil {
				t.Errorf("the relay reported %v for a connection its peer closed", res.Err)
			}
		case <-time.After(closeLinger / 2):
			t.Fatal("the relay still runs after the client closed (the echo blocked on answers nobody reads)")
		}
		select {
		case n := <-echoed:
			if n != int64(sent) {
				t.Fatalf("the echo read %d bytes then EOF (-1: an error), want the %d the client wrote", n, sent)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the echo never saw the end")
		}
	})
	const linger = 2 * time.Second
	stalled := func(t *testing.T) *relayed {
		up, never := net.Pipe() // an upstream that reads nothing
		t.Cleanup(func() { never.Close() })
		r := relayTo(t, transports[0], up, lingering(linger))
		if _, err := r.nc.Write(make([]byte, 1024)); err != nil {
			t.Fatal(err)
		}
		r.nc.Close()
		eventually(t, 5*time.Second, "the CANCELED reached the agent", r.ac.isBroken)
		return r
	}
	t.Run("upstream reads nothing, session ends", func(t *testing.T) {
		r := stalled(t)
		select {
		case <-r.result:
			t.Fatal("the relay gave up the delivery at once")
		default:
		}
		r.agent.Close()
		select {
		case res := <-r.result:
			if !errors.Is(res.Err, errDeliveryCut) {
				t.Errorf("result %v, want errDeliveryCut", res.Err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the relay still runs after its session ended")
		}
	})
	t.Run("upstream reads nothing, linger", func(t *testing.T) {
		start := time.Now()
		r := stalled(t)
		select {
		case res := <-r.result:
			if d := time.Since(start); d < linger {
				t.Fatalf("the relay gave up after %v, before the linger (%v)", d, linger)
			}
			if !errors.Is(res.Err, errDeliveryCut) {
				t.Errorf("result %v, want errDeliveryCut", res.Err)
			}
		case <-time.After(linger + 5*time.Second):
			t.Fatal("the relay still runs past the linger")
		}
	})
}

// TestRelaySessionEndIsACut: the node's session ends (its stream closes
// cleanly: the agent's Recv reads io.EOF, as a gRPC client does when the
// server handler returns) while the agent relays mid-stream (the node sent
// some bytes, no FIN). The relay must cut the upstream (RST) and report an
// error; a clean FIN passes a truncated stream off as whole.
func TestRelaySessionEndIsACut(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		for range 20 {
			upErr := make(chan error, 1)
			up := serveOnce(t, nil, func(c net.Conn) {
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, err := io.ReadAll(c)
				upErr <- err
			})
			r := relayTo(t, tr, up, Relay)
			if _, err := r.nc.Write([]byte("partial")); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "delivered", func() bool { n, _ := r.ac.Counts(); return n == 7 })
			r.node.Close()
			res := <-r.result
			if uerr := <-upErr; res.Err == nil || !errors.Is(uerr, syscall.ECONNRESET) {
				t.Fatalf("session end: relay result %v, upstream read end %v; want an error and a reset", res.Err, uerr)
			}
		}
	})
}

// TestRelayDeliversToASlowEcho: the client writes 2 MiB and closes (DATA,
// FIN, CANCELED). The upstream is an echo that reads slowly (16 KiB every
// 20 ms, ~0.8 MB/s): the agent hands every byte to its socket well before
// the upstream has read them. The relay closes only once the upstream
// acknowledged them: closing with the echo's bytes unread would reset the
// connection and drop the tail of the stream.
func TestRelayDeliversToASlowEcho(t *testing.T) {
	const total = 2 << 20
	type end struct {
		n   int64
		err error
	}
	echoed := make(chan end, 1)
	up := serveOnce(t, nil, func(c net.Conn) {
		buf := make([]byte, 16<<10)
		var n int64
		for {
			m, err := c.Read(buf)
			n += int64(m)
			if m > 0 {
				c.Write(buf[:m])
			}
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				echoed <- end{n, err}
				return
			}
			time.Sleep(20 * time.Millisecond) // the upstream's pace
		}
	})
	r := relayTo(t, transports[0], up, Relay)
	// The client reads nothing of the echo, writes, then closes.
	if _, err := r.nc.Write(make([]byte, total)); err != nil {
		t.Fatal(err)
	}
	r.nc.Close()
	res := <-r.result
	e := <-echoed
	if res.Err != nil || e.n != total || e.err != nil {
		t.Fatalf("relay result %v; the upstream read %d of %d bytes, then %v; want all of them, EOF and a clean result", res.Err, e.n, total, e.err)
	}
}

// TestWriteToBatchShowsProgressPerPiece: with a small write batch, WriteTo
// hands the writer one received piece at a time, so Counts advances with
// each (what an idle watcher reads), instead of once per 256 KiB.
func TestWriteToBatchShowsProgressPerPiece(t *testing.T) {
	_, c, b := nodeWithRawPeer(t, 8, Config{})
	c.SetWriteToBatch(16 << 10)
	peer := rawPeer{t, b}
	for range 4 {
		peer.data(c.ID(), 16<<10)
	}
	eventually(t, 5*time.Second, "the data buffered", func() bool { return c.Buffered() == 64<<10 })
	peer.send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: c.ID()}}})
	w := &recordingWriter{}
	if n, err := c.WriteTo(w); err != nil || n != 64<<10 {
		t.Fatalf("WriteTo = %d, %v", n, err)
	}
	if len(w.writes) != 4 {
		t.Fatalf("writes of %v bytes, want four of 16 KiB", w.writes)
	}
}

type recordingWriter struct{ writes []int }

func (w *recordingWriter) Write(p []byte) (int, error) {
	w.writes = append(w.writes, len(p))
	return len(p), nil
}

// TestRelayPassesAResetOn: an upstream that sends some bytes and then
// resets its connection reaches the other end of the tunnel as an error,
// not as a clean end: a protocol that ends its messages at close can tell a
// truncated stream.
func TestRelayPassesAResetOn(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	nc, _ := node.Open(ConnectInfo{})
	nc.Write([]byte("go"))
	ac := accept(t, agent)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		io.ReadFull(c, make([]byte, 2))
		c.Write([]byte("partial"))
		c.(*net.TCPConn).SetLinger(0)
		c.Close() // RST
	}()
	uc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	go Relay(uc, ac)

	nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	// The kernel may drop "partial" with the reset; what matters is that
	// the stream does not end cleanly.
	got, err := io.ReadAll(nc)
	if (string(got) != "partial" && len(got) != 0) || err == nil {
		t.Fatalf("the tunnel's far end read %q, %v; want the bytes sent, then an error", got, err)
	}
	var perr *PeerError
	if !errors.As(err, &perr) {
		t.Fatalf("read error %v, want the peer's abort", err)
	}
}

// TestErrorMessagesFitTheWire: an abort's reason that is not valid UTF-8
// (quoting bytes from an upstream, say) or is very long still makes a valid
// Error frame: the session goes on and the peer reads a bounded, cleaned
// message.
func TestErrorMessagesFitTheWire(t *testing.T) {
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	nc, _ := node.Open(ConnectInfo{})
	nc.Write([]byte("x"))
	ac := accept(t, agent)
	ac.Abort(tunnelpb.Error_CANCELED, "bad \xff\xfe bytes "+strings.Repeat("é", 1000))
	nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.ReadAll(nc)
	var perr *PeerError
	if !errors.As(err, &perr) {
		t.Fatalf("read error %v, want the peer's abort", err)
	}
	if !utf8.ValidString(perr.Message) || len(perr.Message) > maxErrorMessage || !strings.HasPrefix(perr.Message, "bad \ufffd bytes") {
		t.Fatalf("message %q (%d bytes)", perr.Message, len(perr.Message))
	}
	if err := node.Err(); err != nil {
		t.Fatalf("node session failed: %v", err)
	}
	if err := agent.Err(); err != nil {
		t.Fatalf("agent session failed: %v", err)
	}
}

// TestTCPConnOfLooksThroughWrappers: the connection a relay resets is found
// under a TLS layer (which must not send close_notify for a cut stream).
func TestTCPConnOfLooksThroughWrappers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tc := c.(*net.TCPConn)
	if got := tcpConnOf(tls.Client(tc, &tls.Config{})); got != tc {
		t.Fatalf("tcpConnOf through tls.Conn = %v, want the TCP connection", got)
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got := tcpConnOf(a); got != nil {
		t.Fatalf("tcpConnOf(pipe) = %v, want nil", got)
	}
}
