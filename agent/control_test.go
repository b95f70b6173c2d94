package agent

import (
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
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
	if logs.FilterMessage("node draining").Len() != 1 || logs.FilterMessage("membership update").Len() != 1 ||
		logs.FilterMessage("node reported an error").Len() != 1 {
		t.Errorf("logs: %v", logs.All())
	}
}

// TestOverlapsLoggedOnChange: each overlap the node reports is logged at
// warn when it begins (or its shadowed changes) and at info when it ends;
// acks that repeat it log nothing.
func TestOverlapsLoggedOnChange(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	log := zap.New(core)
	const began, ended = "route also served by an agent of another credential", "route no longer served by an agent of another credential"
	web := &tunnelpb.RouteOverlap{Name: "web", OtherCredential: "team-b", OtherAgentId: "agent-b"}
	api := &tunnelpb.RouteOverlap{Name: "api", OtherAgentId: "agent-c", Shadowed: true} // the node's unscoped token
	webShadowed := &tunnelpb.RouteOverlap{Name: "web", OtherCredential: "team-b", OtherAgentId: "agent-b", Shadowed: true}
	r := newRouteState()
	for i, step := range []struct {
		overlaps     []*tunnelpb.RouteOverlap
		began, ended []string // routes, in log order
	}{
		{[]*tunnelpb.RouteOverlap{web, api}, []string{"web", "api"}, nil},
		{[]*tunnelpb.RouteOverlap{api, web}, nil, nil}, // the same, reordered
		{[]*tunnelpb.RouteOverlap{webShadowed}, []string{"web"}, []string{"api"}},
		{nil, nil, []string{"web"}},
		{nil, nil, nil},
	} {
		logs.TakeAll()
		r.update(log, &tunnelpb.AdvertiseAck{Overlaps: step.overlaps})
		check := func(msg string, lvl zapcore.Level, want []string) {
			var got []string
			for _, e := range logs.FilterMessage(msg).All() {
				if e.Level != lvl {
					t.Errorf("step %d: %q at %v, want %v", i, msg, e.Level, lvl)
				}
				got = append(got, e.ContextMap()["route"].(string))
			}
			if !slices.Equal(got, want) {
				t.Errorf("step %d: %q for %q, want %q", i, msg, got, want)
			}
		}
		check(began, zapcore.WarnLevel, step.began)
		check(ended, zapcore.InfoLevel, step.ended)
	}
	logs.TakeAll()
	r.update(log, &tunnelpb.AdvertiseAck{Overlaps: []*tunnelpb.RouteOverlap{api}})
	e := logs.FilterMessage(began).All()
	if len(e) != 1 {
		t.Fatalf("logs %v", logs.All())
	}
	if m := e[0].ContextMap(); m["other_credential"] != "(token)" || m["other_agent_id"] != "agent-c" || m["shadowed"] != true {
		t.Errorf("fields %v", m)
	}
}

// TestOutOfScopeRejectionsAreNotRetried: a route outside the credential's
// scope schedules no re-Advertise (only the node's config changes it, and
// the node admits it again itself on that reload); other rejections do,
// also beside an out-of-scope one.
func TestOutOfScopeRejectionsAreNotRetried(t *testing.T) {
	r := newReadvertiser(&Agent{backoffInitial: time.Hour, backoffMax: time.Hour}, zap.NewNop())
	defer r.stop()
	outOfScope := &tunnelpb.RejectedRoute{Name: "web", Reason: `out_of_scope: host "web.example.com" of credential "team-a"`}
	portInUse := &tunnelpb.RejectedRoute{Name: ":16379", ListenPort: 16379, Reason: "port in use"}
	for _, tc := range []struct {
		name     string
		rejected []*tunnelpb.RejectedRoute
		retry    bool
	}{
		{"none", nil, false},
		{"out of scope", []*tunnelpb.RejectedRoute{outOfScope}, false},
		{"port in use", []*tunnelpb.RejectedRoute{portInUse}, true},
		{"both", []*tunnelpb.RejectedRoute{outOfScope, portInUse}, true},
		{"out of scope again", []*tunnelpb.RejectedRoute{outOfScope}, false},
	} {
		r.onAck(&tunnelpb.AdvertiseAck{Rejected: tc.rejected})
		if scheduled := r.C() != nil; scheduled != tc.retry {
			t.Errorf("%s: re-Advertise scheduled %v, want %v", tc.name, scheduled, tc.retry)
		}
	}
	core, logs := observer.New(zap.DebugLevel)
	newRouteState().update(zap.New(core), &tunnelpb.AdvertiseAck{Rejected: []*tunnelpb.RejectedRoute{outOfScope}})
	if !hasLog(logs, "route rejected by node", "hint", "not retried") {
		t.Errorf("the out-of-scope rejection was not logged with its hint: %v", logs.All())
	}
}
