package caddymodule

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// testSessionPair starts a node session over an in-memory pipe, and the
// agent's end, which accepts every connection and hands it to the channel.
func testSessionPair(t *testing.T) (*tunnelcore.Session, <-chan *tunnelcore.Conn) {
	t.Helper()
	nodeEnd, agentEnd := tunnelcore.Pipe(16)
	sess, err := tunnelcore.NewSession(nodeEnd, tunnelcore.Config{Role: tunnelcore.RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	peer, err := tunnelcore.NewSession(agentEnd, tunnelcore.Config{Role: tunnelcore.RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	accepted := make(chan *tunnelcore.Conn, 16)
	go func() {
		for {
			c, err := peer.Accept(context.Background())
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	return sess, accepted
}

func testNode(t *testing.T) *node {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	n := newNode("test", nil, zap.NewNop())
	if err := n.serve(func() (net.Listener, error) { return ln, nil }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.drainNow)
	return n
}

// TestTCPConnectionGoesOnToTheNextAgent: a TCP connection routed to an
// agent that left between the lookup and the open (the node had ended its
// session) goes to the agent that serves the route now; with none, it is
// closed.
func TestTCPConnectionGoesOnToTheNextAgent(t *testing.T) {
	n := testNode(t)
	leftSess, _ := testSessionPair(t)
	left := &agentSession{agentID: "agent-a", sess: leftSess, ended: true}
	nextSess, accepted := testSessionPair(t)
	next := &agentSession{agentID: "agent-b", sess: nextSess}
	route := &tunnelpb.Route{Name: "svc", Target: "tcp://127.0.0.1:9"}
	stale, now := &routeEntry{agent: left, route: route}, &routeEntry{agent: next, route: route}

	client, server := net.Pipe()
	defer client.Close()
	relayed := make(chan error, 1)
	go func() { relayed <- n.relayTCPAgain(server, stale, "", func() *routeEntry { return now }) }()
	select {
	case c := <-accepted:
		if c.Info().RouteKey != "svc" {
			t.Fatalf("route key %q", c.Info().RouteKey)
		}
		c.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the connection did not reach the agent serving the route now")
	}
	client.Close()
	select {
	case <-relayed:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not end with its client")
	}

	client, server = net.Pipe()
	defer client.Close()
	if err := n.relayTCPAgain(server, stale, "", func() *routeEntry { return nil }); !errors.Is(err, errAgentLeft) {
		t.Fatalf("with no agent left: %v, want errAgentLeft", err)
	}
	client.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := client.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("client read %v, want EOF (closed)", err)
	}
}

// TestLeavingSessionEndsOnceIdle: after an agent's Drain the node still
// opens connections on its session (a request that chose it just before),
// ends it once none is left, and refuses opens from then on.
func TestLeavingSessionEndsOnceIdle(t *testing.T) {
	n := testNode(t)
	sess, _ := testSessionPair(t)
	a := &agentSession{agentID: "agent-a", sess: sess}
	entries, _ := validateRoutes([]*tunnelpb.Route{{Host: "app.test"}})
	n.reg.bind(a, entries, nil)
	n.reg.register(a, entries)
	info := tunnelcore.ConnectInfo{RouteKey: "app.test"}
	first, err := n.open(context.Background(), a, info)
	if err != nil {
		t.Fatal(err)
	}

	n.leave(a, &tunnelpb.Drain{GraceMs: 60000, Reason: "test"})
	if !a.leaving.Load() || len(n.reg.table.Load().lookupHTTP("app.test")) != 0 {
		t.Fatal("the leaving session's route is still looked up")
	}
	late, err := n.open(context.Background(), a, info)
	if err != nil {
		t.Fatalf("an open on the leaving session with a connection still open: %v", err)
	}
	first.Close()
	select {
	case <-sess.Done():
		t.Fatal("the session ended with a connection open")
	default:
	}
	late.Close()
	testwait.Until(t, 10*time.Second, "the node ends the idle leaving session", func() bool {
		select {
		case <-sess.Done():
			return true
		default:
			return false
		}
	})
	if !errors.Is(sess.Err(), errAgentLeft) {
		t.Fatalf("session ended with %v, want errAgentLeft", sess.Err())
	}
	if _, err := n.open(context.Background(), a, info); !errors.Is(err, errAgentLeft) {
		t.Fatalf("open after the end: %v, want errAgentLeft", err)
	}
}
