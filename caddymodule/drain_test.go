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
	n.token.Store(&tok)
	opts := *n.opts.Load()
	opts.advertiseTimeout = time.Minute
	n.opts.Store(&opts)
	cc, err := grpc.NewClient(n.listener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer secret"))
	defer cancel()
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
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
