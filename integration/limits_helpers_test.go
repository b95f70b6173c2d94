package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/caddymodule"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// stats is the snapshot of this Caddy's node; ok is false when the node is
// not running (not in the pool: stopped, or being destroyed).
func (c *caddyServer) stats() (caddymodule.NodeStats, bool) {
	suffix := ":" + strconv.Itoa(c.controlPort)
	for _, st := range caddymodule.Stats() {
		if strings.HasSuffix(st.Listen, suffix) {
			return st, true
		}
	}
	return caddymodule.NodeStats{}, false
}

func (c *caddyServer) mustStats(t testing.TB) caddymodule.NodeStats {
	t.Helper()
	st, ok := c.stats()
	if !ok {
		t.Fatalf("no sluice node on control port %d", c.controlPort)
	}
	return st
}

// limHoldUpstream is an HTTP upstream whose /hold answers only once the gate
// it arrived under is opened, and whose /stall never reads the request
// body and answers once its gate opens; / answers at once.
type limHoldUpstream struct {
	url     string
	arrived chan string  // the path of each request that reached a handler
	opened  atomic.Int64 // connections accepted so far

	mu   sync.Mutex
	gate chan struct{}
}

func startLimHoldUpstream(t testing.TB) *limHoldUpstream {
	t.Helper()
	h := &limHoldUpstream{arrived: make(chan string, 1024), gate: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	wait := func(r *http.Request) {
		h.mu.Lock()
		g := h.gate
		h.mu.Unlock()
		h.arrived <- r.URL.Path
		select {
		case <-g:
		case <-r.Context().Done():
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hold upstream\n")
	})
	mux.HandleFunc("/hold", func(w http.ResponseWriter, r *http.Request) {
		wait(r)
		io.WriteString(w, "released\n")
	})
	mux.HandleFunc("/stall", func(w http.ResponseWriter, r *http.Request) {
		wait(r) // the body is never read
		w.Header().Set("Connection", "close")
		io.WriteString(w, "released\n")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				h.opened.Add(1)
			}
		}}
	go srv.Serve(ln)
	t.Cleanup(func() {
		h.release()
		srv.Close()
	})
	h.url = "http://" + ln.Addr().String()
	return h
}

// release opens the current gate (answering every held request) and arms
// a new one for the next requests.
func (h *limHoldUpstream) release() {
	h.mu.Lock()
	close(h.gate)
	h.gate = make(chan struct{})
	h.mu.Unlock()
}

// limEchoServer echoes every connection until the client closes; it returns
// the port. Cleanup closes the listener and every connection.
func limEchoServer(t testing.TB) int {
	t.Helper()
	return serveTCP(t, func(c net.Conn) { io.Copy(c, c) })
}

// echoWithin writes msg on c (to an echo upstream) and reads it back within d.
func echoWithin(c net.Conn, msg string, d time.Duration) error {
	c.SetDeadline(time.Now().Add(d))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echo %q, want %q", buf, msg)
	}
	return nil
}

// limClosedWithin reports how long until a read on c ends (EOF or reset), or
// an error if it does not end within d or data arrives.
func limClosedWithin(c net.Conn, d time.Duration) (time.Duration, error) {
	start := time.Now()
	c.SetReadDeadline(start.Add(d))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	took := time.Since(start)
	if n > 0 {
		return took, fmt.Errorf("read %q from a refused connection", buf[:n])
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return took, fmt.Errorf("connection still open after %v", d)
	}
	return took, nil
}

// limControlClient dials the control plane of c the way an agent does, for
// raw Connect streams.
func limControlClient(t testing.TB, c *caddyServer) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", c.controlPort),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// limRawStream is a Connect stream opened by hand; its end is reported on done.
type limRawStream struct {
	st     grpc.BidiStreamingClient[tunnelpb.Frame, tunnelpb.Frame]
	cancel context.CancelFunc
	opened time.Time
	done   chan limRawEnd // the stream's end (first Recv error), once
	frames chan *tunnelpb.Frame
}

type limRawEnd struct {
	err  error
	took time.Duration // since the stream was opened
}

// limOpenRaw opens a Connect stream with the test token and sends nothing; a
// goroutine receives until the stream ends.
func limOpenRaw(t testing.TB, cc *grpc.ClientConn) *limRawStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+testToken)
	r := &limRawStream{cancel: cancel, opened: time.Now(), done: make(chan limRawEnd, 1), frames: make(chan *tunnelpb.Frame, 16)}
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		t.Fatalf("open Connect: %v", err)
	}
	r.st = st
	go func() {
		for {
			f, err := st.Recv()
			if err != nil {
				r.done <- limRawEnd{err: err, took: time.Since(r.opened)}
				return
			}
			select {
			case r.frames <- f:
			default:
			}
		}
	}()
	return r
}

// advertise sends an Advertise for agent id with no routes.
func (r *limRawStream) advertise(id string) error {
	return r.st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: id, Build: "raw-test", InitialWindow: tunnelcore.InitialWindow,
	}}})
}

// end waits up to d for the stream's end (d <= 0: does not wait).
func (r *limRawStream) end(d time.Duration) (limRawEnd, bool) {
	var timeout <-chan time.Time
	if d > 0 {
		timer := time.NewTimer(d)
		defer timer.Stop()
		timeout = timer.C
	} else {
		closed := make(chan time.Time)
		close(closed)
		timeout = closed
	}
	select {
	case e := <-r.done:
		r.done <- e // keep it readable
		return e, true
	default:
	}
	select {
	case e := <-r.done:
		r.done <- e
		return e, true
	case <-timeout:
		return limRawEnd{}, false
	}
}

func limStatus(err error) string {
	st := status.Convert(err)
	return st.Code().String() + ": " + st.Message()
}

// limStalledDownload opens GET path on Caddy's HTTP port with a raw client,
// reads the response head and then stops reading. It returns the conn
// (close it to end the download) and the status line.
func limStalledDownload(t testing.TB, c *caddyServer, host, path string) (net.Conn, string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", c.httpPort), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	// A small receive buffer keeps what the kernel absorbs modest.
	conn.(*net.TCPConn).SetReadBuffer(64 << 10)
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, host)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReaderSize(conn, 4096)
	statusLine, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("download head: %v", err)
	}
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("download head: %v", err)
		}
		if line == "\r\n" {
			break
		}
	}
	conn.SetReadDeadline(time.Time{})
	return conn, strings.TrimSpace(statusLine)
}

// limZeroReader is an endless body.
type limZeroReader struct{}

func (limZeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// limDialEcho dials addr and completes one echo exchange through it.
func limDialEcho(addr string) error {
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	return echoWithin(conn, "ping", 2*time.Second)
}
