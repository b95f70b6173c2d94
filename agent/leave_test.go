package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// echoOnce opens a connection to the echo route and checks one round trip.
func echoOnce(t *testing.T, sess *tunnelcore.Session) net.Conn {
	t.Helper()
	c, err := sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	mustEcho(t, c)
	return c
}

func mustEcho(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo %q %v", buf, err)
	}
}

// leaveAsync calls Leave in the background; the channel gets its result.
func leaveAsync(ag *runningAgent, ctx context.Context) <-chan error {
	done := make(chan error, 1)
	go func() { done <- ag.Leave(ctx) }()
	return done
}

func TestLeaveLetsOpenConnectionsFinish(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echoUpstream(t)}))
	ns := node.next(t)
	c := echoOnce(t, ns.sess)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	left := leaveAsync(ag, ctx)

	var d *tunnelpb.Drain
	select {
	case d = <-ns.drains:
	case <-time.After(10 * time.Second):
		t.Fatal("no Drain from the leaving agent")
	}
	if d.GetReason() != "agent shutting down" || d.GetGraceMs() == 0 || d.GetGraceMs() > 60000 {
		t.Fatalf("Drain %v: want the reason and the grace left (at most 60 s)", d)
	}
	waitFor(t, 10*time.Second, "the node's answer", func() bool { return hasLog(ag.logs, "node withdrew the routes", "", "") })

	// Still serving: the open connection, and one the node opened as the
	// Drain crossed its answer.
	mustEcho(t, c)
	late := echoOnce(t, ns.sess)
	select {
	case err := <-left:
		t.Fatalf("Leave returned %v with two connections open", err)
	default:
	}

	c.Close()
	late.Close()
	select {
	case err := <-left:
		if err != nil {
			t.Fatalf("Leave: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Leave did not return once the connections closed")
	}
	if err := ag.stop(t); err != nil || ag.State() != StateStopped {
		t.Fatalf("Run returned %v, state %v", err, ag.State())
	}
	select {
	case <-ns.sess.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not end its session")
	}
	if !hasLog(ag.logs, "left the node: every connection finished", "", "") {
		t.Error("no line saying the agent left cleanly")
	}
	if n := node.attempts.Load(); n != 1 {
		t.Fatalf("the agent reconnected after leaving: %d attempts", n)
	}
}

// A node that does not answer Drain (older than this agent) keeps the agent
// until the grace is over; what is open then is cut.
// TestLeaveWithNothingOpenSaysSo: with no connection open, the node answers
// the Drain and ends the session at once; the agent takes the answer that
// came before the end and says it left cleanly, every time (the two used
// to race, and the line said the session ended while leaving).
func TestLeaveWithNothingOpenSaysSo(t *testing.T) {
	const rounds = 10
	for i := range rounds {
		node := newFakeNode(t, "secret", nodeOptions{})
		ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echoUpstream(t)}))
		node.next(t)
		waitFor(t, 10*time.Second, "connected", func() bool { return ag.State() == StateConnected })
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		select {
		case err := <-leaveAsync(ag, ctx):
			if err != nil {
				t.Fatalf("round %d: Leave: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: Leave did not return", i)
		}
		cancel()
		if !hasLog(ag.logs, "left the node: every connection finished", "", "") {
			t.Fatalf("round %d: no line saying the agent left cleanly: %v", i, ag.logs.All())
		}
	}
}

func TestLeaveCutsWhatTheGraceLeavesOpen(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{silentOnDrain: true})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echoUpstream(t)}))
	ns := node.next(t)
	c := echoOnce(t, ns.sess)

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	select {
	case err := <-leaveAsync(ag, ctx):
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Leave: %v, want DeadlineExceeded", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Leave outlived its grace")
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the open connection was not cut: %v", err)
	}
	if !hasLog(ag.logs, "shutdown grace over", "", "") {
		t.Error("no line saying the grace cut connections")
	}
}

// Leave while the agent waits to reconnect, or before Run, stops it at once.
func TestLeaveWhileDisconnectedStopsAtOnce(t *testing.T) {
	ag := startAgent(t, testConfig(freeAddr(t), "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}))
	waitFor(t, 10*time.Second, "a failed attempt", func() bool { return hasLog(ag.logs, "connection failed", "", "") })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	select {
	case err := <-leaveAsync(ag, ctx):
		if err != nil {
			t.Fatalf("Leave: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Leave of a disconnected agent did not return")
	}

	a, err := New(testConfig(freeAddr(t), "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Leave(context.Background()); err != nil {
		t.Fatalf("Leave before Run: %v", err)
	}
	ran := make(chan error, 1)
	go func() { ran <- a.Run(context.Background()) }()
	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("Run after Leave: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run after Leave did not return")
	}
}

// freeAddr is a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
