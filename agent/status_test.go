package agent

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestStatusShowsCredentialAndOverlaps: /status shows per session the
// credential the node authenticated it as and the routes that agents of
// other credentials serve too, as the node's latest ack (also one it sends
// unprompted) states them; nothing of it once the session is gone.
func TestStatusShowsCredentialAndOverlaps(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{ack: func(adv *tunnelpb.Advertise, _ int) *tunnelpb.AdvertiseAck {
		ack := acceptAll(adv)
		ack.Credential = "team-a"
		ack.Overlaps = []*tunnelpb.RouteOverlap{
			{Name: "web", OtherCredential: "team-b", OtherAgentId: "agent-b", Shadowed: true},
			{Name: "web", OtherAgentId: "agent-c"},
		}
		return ack
	}})
	cfg := testConfig(node.addr, "secret", Upstream{Name: "web", Host: "web.example.com", Target: "http://127.0.0.1:1"})
	cfg.AdminListen = "127.0.0.1:0"
	ag := startAgent(t, cfg)
	ns := node.next(t)
	waitFor(t, 5*time.Second, "the connected session", func() bool { return ag.State() == StateConnected })

	want := []OverlapStatus{
		{Route: "web", OtherCredential: "team-b", OtherAgentID: "agent-b", Shadowed: true},
		{Route: "web", OtherCredential: "(token)", OtherAgentID: "agent-c"},
	}
	if s := adminStatus(t, ag.Agent).Sessions[0]; s.Credential != "team-a" || !slices.Equal(s.Overlaps, want) {
		t.Errorf("session %+v, want credential team-a and overlaps %+v", s, want)
	}
	body := compactStatus(t, ag.Agent)
	if w := `"credential":"team-a","overlaps":[{"route":"web","other_credential":"team-b","other_agent_id":"agent-b","shadowed":true},`; !strings.Contains(body, w) {
		t.Errorf("/status %s\nlacks %s", body, w)
	}
	if !hasLog(ag.logs, "connected", "credential", "team-a") {
		t.Error(`no "connected" line naming the credential`)
	}

	// The other agents left: the node says so in an ack of its own.
	ack := acceptAll(ns.adv)
	ack.Credential = "team-a"
	if err := ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the overlaps to end", func() bool { return len(ag.Status().Sessions[0].Overlaps) == 0 })
	if body := compactStatus(t, ag.Agent); !strings.Contains(body, `"credential":"team-a","overlaps":[]`) {
		t.Errorf("/status %s: want the credential and an empty overlaps list", body)
	}
	if n := ag.logs.FilterMessage("route no longer served by an agent of another credential").Len(); n != 2 {
		t.Errorf("%d ends of overlaps logged, want 2", n)
	}

	node.stop()
	waitFor(t, 5*time.Second, "the session's end", func() bool { return ag.State() != StateConnected })
	if s := ag.Status().Sessions[0]; s.Credential != "" || s.Overlaps == nil || len(s.Overlaps) != 0 {
		t.Errorf("after the session: %+v", s)
	}
}

// compactStatus is /status without white space.
func compactStatus(t *testing.T, a *Agent) string {
	t.Helper()
	_, body := adminGet(t, a, "/status")
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(body)); err != nil {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	return b.String()
}
