package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// listenFast is Listen with a fast backoff, closed at cleanup.
func listenFast(t *testing.T, cfg *Config, routes []Upstream, opts ...Option) *Listener {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	opts = append([]Option{WithBackoff(20*time.Millisecond, 200*time.Millisecond)}, opts...)
	l, err := ListenRoutes(ctx, cfg, routes, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := l.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return l
}

// acceptOne accepts one connection from l, failing the test after 10 s.
func acceptOne(t *testing.T, l *Listener) *Conn {
	t.Helper()
	got := make(chan net.Conn, 1)
	errc := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			errc <- err
			return
		}
		got <- c
	}()
	select {
	case c := <-got:
		return c.(*Conn)
	case err := <-errc:
		t.Fatalf("Accept: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Accept returned nothing within 10s")
	}
	return nil
}

func TestListenDeliversConnections(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	reports := make(chan ConnReport, 4)
	cfg := testConfig(node.addr, "secret")
	l := listenFast(t, cfg, []Upstream{{Host: "App.Test"}, {Name: "raw", Target: "tcp://"}},
		WithConnEnd(func(r ConnReport) { reports <- r }))
	if len(cfg.Upstreams) != 0 || cfg.ID != "agent-test" || cfg.KeepaliveTime != 0 {
		t.Errorf("Listen changed the caller's config: %+v", cfg)
	}
	if a := l.Addr(); a.Network() != "sluice" || a.String() != "app.test,raw" {
		t.Errorf("Addr %s %q", a.Network(), a.String())
	}
	ns := node.next(t)
	targets := map[string]string{}
	for _, r := range ns.adv.GetRoutes() {
		targets[r.GetName()] = r.GetTarget()
	}
	if targets["app.test"] != "http://in-process" || targets["raw"] != "tcp://in-process" {
		t.Errorf("advertised targets %v", targets)
	}

	const client = "203.0.113.9:4321"
	nc, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test", RemoteAddr: client})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	c := acceptOne(t, l)
	if c.Route() != "app.test" || c.RemoteAddr().String() != client {
		t.Errorf("accepted route %q from %v", c.Route(), c.RemoteAddr())
	}
	if n := l.Agent().ActiveConns(); n != 1 {
		t.Errorf("ActiveConns %d with one connection accepted, want 1", n)
	}

	// Both ways, and half-closes each way.
	if _, err := nc.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	nc.CloseWrite()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := io.ReadAll(c); err != nil || string(got) != "ping" {
		t.Fatalf("program read %q %v", got, err)
	}
	if _, err := c.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(nc); err != nil || string(got) != "pong" {
		t.Fatalf("node read %q %v", got, err)
	}

	// Deadlines: a read past its deadline fails as a net.Conn's does.
	nc2, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "raw"})
	if err != nil {
		t.Fatal(err)
	}
	defer nc2.Close()
	c2 := acceptOne(t, l)
	c2.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := c2.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read past the deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	if c2.Route() != "raw" {
		t.Errorf("second connection's route %q", c2.Route())
	}
	c2.Close()

	c.Close()
	c.Close() // idempotent: one report
	for range 2 {
		select {
		case r := <-reports:
			if r.Route == "app.test" && (r.Outcome != ConnOK || r.FromClient != 4 || r.ToClient != 4 || r.ClientAddr != client || r.Target != "http://in-process") {
				t.Errorf("report %+v", r)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no report of a closed connection")
		}
	}
	select {
	case r := <-reports:
		t.Errorf("extra report %+v", r)
	default:
	}
	waitFor(t, 5*time.Second, "ActiveConns 0 after both closed", func() bool { return l.Agent().ActiveConns() == 0 })
}

func TestListenCloseWithdraws(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	l := listenFast(t, testConfig(node.addr, "secret"), []Upstream{{Host: "app.test"}})
	ns := node.next(t)

	// A connection accepted before Close stays usable after it.
	nc, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test"})
	if err != nil {
		t.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	c := acceptOne(t, l)
	// One left waiting for Accept is refused by Close.
	waiting, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test"})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the second connection in the backlog", func() bool { return len(l.queue) == 1 })

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
	}
	if pe := peerError(t, waiting); pe.Code != tunnelpb.Error_REFUSED {
		t.Errorf("waiting connection ended with %v, want REFUSED", pe)
	}
	select {
	case <-ns.drains:
	case <-time.After(10 * time.Second):
		t.Fatal("Close sent the node no Drain")
	}
	if _, err := c.Write([]byte("still here")); err != nil {
		t.Fatalf("write on an accepted connection after Close: %v", err)
	}
	buf := make([]byte, len("still here"))
	if _, err := io.ReadFull(nc, buf); err != nil || string(buf) != "still here" {
		t.Fatalf("node read %q %v", buf, err)
	}
	select {
	case <-l.Done():
		t.Fatal("the agent stopped while a connection was open")
	default:
	}
	c.Close()
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop once the last connection closed")
	}
}

// TestListenAcceptEndsWhenAgentStops: an agent that stops without the
// Listener's Close (its Leave called directly) ends a blocked Accept with
// net.ErrClosed, rather than leaving it waiting for good.
func TestListenAcceptEndsWhenAgentStops(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	l := listenFast(t, testConfig(node.addr, "secret"), []Upstream{{Host: "app.test"}})
	node.next(t)
	errc := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if c != nil {
			c.Close()
		}
		errc <- err
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.Agent().Leave(ctx); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after the agent stopped: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Accept still blocked 10s after the agent stopped")
	}
}

func TestListenShutdownCutsAtDeadline(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	l := listenFast(t, testConfig(node.addr, "secret"), []Upstream{{Host: "app.test"}})
	ns := node.next(t)
	nc, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test"})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c := acceptOne(t, l)
	// The program's read ends when the agent cuts the connection, and it
	// closes the connection then, as a server does.
	readErr := make(chan error, 1)
	go func() {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := c.Read(make([]byte, 1))
		c.Close()
		readErr <- err
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := l.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with a connection open: %v, want DeadlineExceeded", err)
	}
	if err := <-readErr; err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read on a connection of a stopped agent: %v, want its end", err)
	}
}

func TestListenRejectedRoute(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{ack: func(adv *tunnelpb.Advertise, _ int) *tunnelpb.AdvertiseAck {
		ack := &tunnelpb.AdvertiseAck{NodeId: "node-1", InitialWindow: tunnelcore.InitialWindow}
		for _, r := range adv.GetRoutes() {
			ack.Rejected = append(ack.Rejected, &tunnelpb.RejectedRoute{Name: r.GetName(), Reason: "host outside the credential's scope"})
		}
		return ack
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Listen(ctx, testConfig(node.addr, "secret"), Upstream{Host: "app.test"}, WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err == nil {
		l.Close()
		t.Fatal("Listen succeeded with its route rejected")
	}
	if !strings.Contains(err.Error(), "app.test (host outside the credential's scope)") {
		t.Errorf("error %q does not name the route and the reason", err)
	}
}

func TestListenNoNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := Listen(ctx, testConfig(closedPort(t), "secret"), Upstream{Host: "app.test"}, WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no node acknowledged") {
		t.Errorf("Listen without a node: %v", err)
	}
}

func TestListenInvalidRoute(t *testing.T) {
	cases := []struct {
		route Upstream
		want  string
	}{
		{Upstream{Host: "a.test", Target: "https://127.0.0.1:1"}, "routes[0].target: scheme \"https\" not supported for a route served in-process"},
		{Upstream{Name: "dns", Target: "udp://"}, "routes[0].target: scheme \"udp\""},
		{Upstream{Host: "a.test", Target: "127.0.0.1:80"}, "routes[0].target: \"127.0.0.1:80\": a route served in-process takes http://"},
		{Upstream{ListenPort: 16000, Target: "tcp://", ProxyProtocol: "v2"}, "routes[0].proxy_protocol: not valid on a route served in-process"},
		{Upstream{ListenPort: 16000}, "routes[0].listen_port: requires a tcp:// target"},
	}
	for _, tc := range cases {
		_, err := Listen(context.Background(), testConfig("127.0.0.1:1", "secret"), tc.route)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", tc.route, err, tc.want)
		}
	}
	if _, err := ListenRoutes(context.Background(), testConfig("127.0.0.1:1", "secret"), nil); err == nil {
		t.Error("ListenRoutes without routes succeeded")
	}
	if _, err := Listen(context.Background(), nil, Upstream{Host: "a.test"}); err == nil {
		t.Error("Listen without a config succeeded")
	}
}

func TestListenBacklogFull(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	l := listenFast(t, testConfig(node.addr, "secret"), []Upstream{{Host: "app.test"}})
	ns := node.next(t)
	// Fill the backlog directly: opening 512 connections through the
	// session would test the session's own limits too.
	for range listenBacklog {
		if err := l.deliver(&Conn{}); err != nil {
			t.Fatal(err)
		}
	}
	nc, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test"})
	if err != nil {
		t.Fatal(err)
	}
	if pe := peerError(t, nc); pe.Code != tunnelpb.Error_RESOURCE_EXHAUSTED {
		t.Errorf("connection beyond the backlog ended with %v, want RESOURCE_EXHAUSTED", pe)
	}
	// The placeholders hold no connection: empty the queue before the
	// cleanup's Close would refuse them.
	for range listenBacklog {
		<-l.queue
	}
}
