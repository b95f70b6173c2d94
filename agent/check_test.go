package agent

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/ident"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestCheckReportsTheAck: Check advertises the configured routes under an
// id of its own, reports the node's ack (accepted, rejected with reasons,
// overlaps, node id, build, credential) and leaves the node with Drain.
func TestCheckReportsTheAck(t *testing.T) {
	node := newFakeNode(t, "tok", nodeOptions{id: "node-7", ack: func(adv *tunnelpb.Advertise, n int) *tunnelpb.AdvertiseAck {
		if n > 1 {
			return nil
		}
		return &tunnelpb.AdvertiseAck{
			NodeId: "node-7", Build: "sluice-node v1 (go)", Credential: "team-a",
			Accepted: []*tunnelpb.RouteKey{{Name: "a.example.com"}},
			Rejected: []*tunnelpb.RejectedRoute{{Name: ":17000", ListenPort: 17000, Reason: "port 17000 is outside tcp_port_range 16000-16099"}},
			Overlaps: []*tunnelpb.RouteOverlap{{Name: "a.example.com", OtherCredential: "team-b", OtherAgentId: "other", Shadowed: true}},
		}
	}})
	cfg := testConfig(node.addr, "tok",
		Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"},
		Upstream{ListenPort: 17000, Target: "tcp://127.0.0.1:1"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := Check(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(res.AgentID, "agent-test-check-") {
		t.Errorf("agent id %q: want agent-test-check-<random>", res.AgentID)
	}
	if len(res.Nodes) != 1 {
		t.Fatalf("%d nodes", len(res.Nodes))
	}
	n := res.Nodes[0]
	if n.Err != nil || n.NodeID != "node-7" || n.NodeBuild != "sluice-node v1 (go)" || n.Credential != "team-a" ||
		n.Server != "grpc://"+node.addr {
		t.Fatalf("node: %+v", n)
	}
	if len(n.Accepted) != 1 || n.Accepted[0] != "a.example.com" {
		t.Errorf("accepted %v", n.Accepted)
	}
	if want := (RejectedRoute{Name: ":17000", ListenPort: 17000, Reason: "port 17000 is outside tcp_port_range 16000-16099"}); len(n.Rejected) != 1 || n.Rejected[0] != want {
		t.Errorf("rejected %+v", n.Rejected)
	}
	if want := (RouteOverlap{Route: "a.example.com", OtherCredential: "team-b", OtherAgentID: "other", Shadowed: true}); len(n.Overlaps) != 1 || n.Overlaps[0] != want {
		t.Errorf("overlaps %+v", n.Overlaps)
	}
	verdict := res.Err()
	if !errors.Is(verdict, ErrCheckRejected) || errors.Is(verdict, ErrCheckUnreachable) ||
		!strings.Contains(verdict.Error(), ":17000 on node node-7: port 17000 is outside") {
		t.Errorf("verdict %v", verdict)
	}

	ns := node.next(t)
	if got := ns.adv.GetAgentId(); got != res.AgentID {
		t.Errorf("advertised as %q, reported %q", got, res.AgentID)
	}
	if got := ns.md.Get("x-sluice-id"); len(got) != 1 || got[0] != res.AgentID {
		t.Errorf("x-sluice-id %v", got)
	}
	select {
	case d := <-ns.drains:
		if d.GetReason() != "check done" {
			t.Errorf("drain reason %q", d.GetReason())
		}
	default:
		t.Error("the check left without Drain")
	}
}

// TestCheckAllAccepted: a node that accepts every route gives no error.
func TestCheckAllAccepted(t *testing.T) {
	node := newFakeNode(t, "tok", nodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := Check(ctx, testConfig(node.addr, "tok", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"}), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Err(); err != nil {
		t.Fatalf("verdict: %v", err)
	}
	if n := res.Nodes[0]; len(n.Accepted) != 1 || len(n.Rejected) != 0 {
		t.Fatalf("node: %+v", n)
	}
}

// TestCheckWrongToken: a refused credential is reported as an
// authentication failure of that node, not as a configuration error.
func TestCheckWrongToken(t *testing.T) {
	node := newFakeNode(t, "tok", nodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := Check(ctx, testConfig(node.addr, "wrong", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"}), nil)
	if err != nil {
		t.Fatal(err)
	}
	verdict := res.Err()
	if !errors.Is(verdict, ErrCheckUnreachable) || !strings.Contains(verdict.Error(), "authentication failed") {
		t.Fatalf("verdict %v", verdict)
	}
	if node.authFailed.Load() == 0 {
		t.Error("the node saw no refused attempt")
	}
}

// TestCheckInvalidConfig: an invalid configuration is Check's error, and
// nothing is dialed.
func TestCheckInvalidConfig(t *testing.T) {
	_, err := Check(context.Background(), &Config{Server: "grpc://127.0.0.1:1", Token: "tok",
		Upstreams: []Upstream{{Host: "a.example.com", Target: "ftp://x"}}}, nil)
	if err == nil || !strings.Contains(err.Error(), "target") {
		t.Fatalf("err %v: want one naming the target", err)
	}
}

// TestCheckID: the check's id keeps the configured one recognisable,
// stays within the length the node accepts and sorts after it.
func TestCheckID(t *testing.T) {
	if id := checkID("web-1"); !strings.HasPrefix(id, "web-1-check-") || len(id) != len("web-1-check-")+8 {
		t.Errorf("checkID(web-1) = %q", id)
	}
	long := strings.Repeat("x", ident.MaxIDLength)
	if id := checkID(long); len(id) != ident.MaxIDLength || ident.CheckID(id) != nil || !strings.Contains(id, "-check-") {
		t.Errorf("checkID(128 x) = %q", id)
	}
	// It sorts after the configured id (the node's routing order), also
	// when that is cut to make room for the suffix.
	for _, id := range []string{"web-1", long, strings.Repeat("b", ident.MaxIDLength-10), strings.Repeat("c", 110) + strings.Repeat("~", 18)} {
		if c := checkID(id); c <= id || len(c) > ident.MaxIDLength || ident.CheckID(c) != nil {
			t.Errorf("checkID(%q) = %q: want a valid id that sorts after it", id, c)
		}
	}
	if first, second := checkID("a"), checkID("a"); first == second {
		t.Error("two checks of one id share an id")
	}
}

// TestSplitRejected: a listen port refused only because the agent of the
// configured id holds it is no rejection; any other reason, or another
// agent holding the port, is one.
func TestSplitRejected(t *testing.T) {
	in := []*tunnelpb.RejectedRoute{
		{Name: ":16000", ListenPort: 16000, Reason: tunnelpb.PortHeldReason(16000, "agent-main")},
		{Name: ":16001", ListenPort: 16001, Reason: tunnelpb.PortHeldReason(16001, "agent-other")},
		{Name: ":17000", ListenPort: 17000, Reason: "port 17000 is outside tcp_port_range 16000-16099"},
		{Name: "app.test", Reason: tunnelpb.PortHeldReason(0, "agent-main")},
	}
	refused, held := splitRejected(in, "agent-main")
	if len(held) != 1 || held[0].ListenPort != 16000 {
		t.Fatalf("held %+v, want :16000 alone", held)
	}
	if len(refused) != 3 || refused[0].Name != ":16001" || refused[1].Name != ":17000" || refused[2].Name != "app.test" {
		t.Fatalf("rejected %+v, want :16001, :17000 and app.test", refused)
	}
}
