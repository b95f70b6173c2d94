package agent

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestControlHandlersNeverBlock: the handlers run on the session's receive
// loop: a second Drain, and acks nobody took yet, must not block it.
func TestControlHandlersNeverBlock(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	c := newControl(zap.New(core))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 3 {
			c.dispatch(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: uint32(1000 * (i + 1))}}})
			c.dispatch(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: &tunnelpb.AdvertiseAck{NodeId: string(rune('a' + i))}}})
		}
		c.dispatch(&tunnelpb.Frame{Kind: &tunnelpb.Frame_MembershipUpdate{MembershipUpdate: &tunnelpb.MembershipUpdate{
			Nodes: []*tunnelpb.Node{{Id: "n1", Url: "grpc://n1:8001"}}}}})
		c.dispatch(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Error{Error: &tunnelpb.Error{Code: tunnelpb.Error_REFUSED, Message: "no"}}})
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a control handler blocked")
	}
	if g := <-c.drains; g != time.Second || !c.nodeDrained() {
		t.Errorf("grace %v drained %v, want the first Drain's 1s", g, c.nodeDrained())
	}
	select {
	case g := <-c.drains:
		t.Errorf("a second Drain passed on (%v)", g)
	default:
	}
	<-c.acks.ready
	if ack := c.acks.take(); ack.GetNodeId() != "c" {
		t.Errorf("took ack of %q, want the newest (c)", ack.GetNodeId())
	}
	if logs.FilterMessage("node draining").Len() != 1 || logs.FilterMessage("membership update (ignored)").Len() != 1 ||
		logs.FilterMessage("node reported an error").Len() != 1 {
		t.Errorf("logs: %v", logs.All())
	}
}
