package caddymodule

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestLeavingSessionEndsOnceIdle: after an agent's Drain the node still
// opens connections on its session (a request that chose it just before),
// ends it once none is left, and refuses opens from then on.
func TestLeavingSessionEndsOnceIdle(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	n := newNode("test", ln, nil, zap.NewNop())
	defer n.drainNow()

	nodeEnd, agentEnd := tunnelcore.Pipe(16)
	sess, err := tunnelcore.NewSession(nodeEnd, tunnelcore.Config{Role: tunnelcore.RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	peer, err := tunnelcore.NewSession(agentEnd, tunnelcore.Config{Role: tunnelcore.RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	go func() { // the agent: accept and hold every connection
		for {
			if _, err := peer.Accept(context.Background()); err != nil {
				return
			}
		}
	}()

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
