package caddymodule

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestPendingStreamEndsAtDrainStart: a stream authorized before the node
// started draining, and still waiting for its Advertise, is ended when the
// drain starts (UNAVAILABLE), instead of registering afterwards as a
// session of the draining node that never gets the Drain.
func TestPendingStreamEndsAtDrainStart(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	storeToken(t, n, tok)
	opts := *n.opts.Load()
	opts.advertiseTimeout = time.Minute
	n.opts.Store(&opts)
	st, err := connectStream(t, controlClient(t, n), "secret")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 5*time.Second, "the stream awaiting its Advertise", func() bool { return n.pending.count() == 1 })

	// What watchExit does when the process starts to exit.
	n.draining.Store(true)
	n.drainNow()

	ended := make(chan error, 1)
	go func() {
		_, err := st.Recv()
		ended <- err
	}()
	select {
	case err := <-ended:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("the pending stream ended with %v, want UNAVAILABLE", status.Convert(err))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the pending stream was not ended when the drain started")
	}
	if got := len(n.reg.sessions()); got != 0 {
		t.Fatalf("%d sessions registered on the draining node", got)
	}
}

// controlClient is a gRPC client of n's control listener, closed at the
// test's end.
func controlClient(t *testing.T, n *node) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(n.listener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// connectStream opens a Connect stream on cc with token, ended at the
// test's end.
func connectStream(t *testing.T, cc *grpc.ClientConn, token string) (grpc.BidiStreamingClient[tunnelpb.Frame, tunnelpb.Frame], error) {
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token))
	t.Cleanup(cancel)
	return tunnelpb.NewTunnelClient(cc).Connect(ctx)
}

// TestReconnectSpread: 2 ms per drained session, at least 1 s (a few
// agents reconnect as before) and at most 60 s.
func TestReconnectSpread(t *testing.T) {
	for _, tc := range []struct {
		sessions int
		want     time.Duration
	}{
		{0, time.Second},
		{1, time.Second},
		{500, time.Second},
		{501, 1002 * time.Millisecond},
		{1000, 2 * time.Second},
		{10_000, 20 * time.Second},
		{30_000, time.Minute},
		{1_000_000, time.Minute},
	} {
		if got := reconnectSpread(tc.sessions); got != tc.want {
			t.Errorf("reconnectSpread(%d) = %v, want %v", tc.sessions, got, tc.want)
		}
	}
}

// TestDrainCarriesReconnectSpread: the Drain a node sends its sessions
// when it shuts down asks for the spread of their number.
func TestDrainCarriesReconnectSpread(t *testing.T) {
	n := testNode(t)
	_, frames := registerAgent(t, n, "agent-a")
	registerAgent(t, n, "agent-b")
	n.drain()
	for {
		f := frames.next(t)
		d := f.GetDrain()
		if d == nil {
			continue // the AdvertiseAck
		}
		if d.GetReconnectSpreadMs() != 1000 || d.GetReason() != "node shutting down" {
			t.Fatalf("Drain %v, want reconnect_spread_ms 1000", d)
		}
		return
	}
}
