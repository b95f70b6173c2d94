package caddymodule

import (
	"context"
	"testing"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestDeadStreamIsNotRegistered: a stream whose agent gave up while it
// waited for admitMu (its context ended: the agent's ack timeout passed,
// and it retries on a new stream) is refused when its turn comes, without
// starting a session or registering routes (bench/scale.sh: at ~7,000
// agents such dead sessions filled max_sessions).
func TestDeadStreamIsNotRegistered(t *testing.T) {
	n := newNode("test", nil, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	h := &handshake{n: n, remote: "192.0.2.1:4000", streamCtx: ctx, cancel: cancel,
		op: opening{adv: &tunnelpb.Advertise{AgentId: "gone", Routes: []*tunnelpb.Route{{Host: "gone.test"}}}}}
	cancel() // the agent gave up while the stream waited

	err := h.negotiateAndRegister()
	if status.Code(err) != codes.Canceled {
		t.Fatalf("negotiateAndRegister = %v, want Canceled", err)
	}
	if h.a != nil || len(n.reg.sessions()) != 0 || len(n.reg.table.Load().lookupHTTP("gone.test")) != 0 {
		t.Error("the dead stream's session was registered")
	}
	if got := n.metrics.streamsRefused[refusedStreamEnded].Load(); got != 1 {
		t.Errorf("stream_ended refusals = %d, want 1", got)
	}
}
