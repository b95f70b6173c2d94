package caddymodule

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestControlConnectionsWithoutTheTokenAreBounded: connections that never
// present the token count against max_pending_streams_per_address (those
// past it are closed at once) and are closed after the time allowed,
// while a connection that carried a Connect with the token stays.
func TestControlConnectionsWithoutTheTokenAreBounded(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	n.token.Store(&tok)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 3, advertiseTimeout: time.Minute, drainGrace: time.Second})
	n.guard.lifetime.Store(int64(time.Second))

	// An agent, proven by its Connect, before the idle ones.
	st, err := connectStream(t, controlClient(t, n), "secret")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 5*time.Second, "the agent's stream authorized", func() bool { return n.pending.count() == 1 })

	// Clients with a wrong token: each Connect is refused, and gRPC alone
	// would keep their connections (MaxConnectionIdle restarts with every
	// stream).
	var clients []*grpc.ClientConn
	for i := range 4 {
		c := controlClient(t, n)
		s, err := connectStream(t, c, "wrong")
		if err == nil {
			_, err = s.Recv()
		}
		want := codes.Unauthenticated
		if i == 3 { // past max_pending_streams_per_address: closed at accept
			want = codes.Unavailable
		}
		if status.Code(err) != want {
			t.Fatalf("client %d: %v, want %v", i, err, want)
		}
		clients = append(clients, c)
	}
	for i, c := range clients[:3] {
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		for c.GetState() == connectivity.Ready && c.WaitForStateChange(wctx, connectivity.Ready) {
		}
		wcancel()
		if c.GetState() == connectivity.Ready {
			t.Fatalf("client %d without the token still connected after the time allowed", i)
		}
	}
	testwait.Until(t, 5*time.Second, "the unproven connections forgotten", func() bool {
		n.guard.mu.Lock()
		defer n.guard.mu.Unlock()
		return len(n.guard.unproven) == 0
	})

	// The agent's connection outlived them: its Advertise is answered.
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: "agent-a", InitialWindow: tunnelcore.InitialWindow, Routes: []*tunnelpb.Route{{Host: "app.test"}},
	}}}); err != nil {
		t.Fatal(err)
	}
	f, err := st.Recv()
	if err != nil || f.GetAdvertiseAck() == nil {
		t.Fatalf("the agent's stream after the idle connections were closed: %v %v", f, err)
	}
}
