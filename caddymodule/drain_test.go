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
