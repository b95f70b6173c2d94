package caddymodule

import (
	"strings"
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// lbRoutes registers agents a, b and c (out of order) serving route rt
// each, and returns the table's routes of rt's name, in routing order.
func lbRoutes(t *testing.T, rt func() *tunnelpb.Route) []*routeEntry {
	t.Helper()
	r := newRegistry()
	for _, id := range []string{"c", "a", "b"} {
		register(t, r, id, rt())
	}
	routes := r.table.Load().lookupName(rt().GetName())
	if got := agentsOf(routes); got != "a:svc,b:svc,c:svc" {
		t.Fatalf("routes %s, want a, b and c's", got)
	}
	return routes
}

func namedTCP() *tunnelpb.Route { return &tunnelpb.Route{Name: "svc", Target: "tcp://127.0.0.1:9"} }

// picks returns the agent ids of n choices of p among routes.
func picks(p *LBPolicy, routes []*routeEntry, n int) string {
	var ids []string
	for range n {
		ids = append(ids, p.pick(routes).agent.agentID)
	}
	return strings.Join(ids, "")
}

func mustPolicy(t *testing.T, name string) *LBPolicy {
	t.Helper()
	p, err := NewLBPolicy(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestLBPolicyPick: first always takes the smallest agent id (also as the
// nil policy and ""), round_robin takes each in turn, random takes every
// one sooner or later, least_conn the fewest open, the first on a tie.
// One route is taken whatever the policy, none gives nil.
func TestLBPolicyPick(t *testing.T) {
	routes := lbRoutes(t, namedTCP)
	for _, p := range []*LBPolicy{nil, mustPolicy(t, ""), mustPolicy(t, LBFirst)} {
		if got := picks(p, routes, 4); got != "aaaa" {
			t.Errorf("%s: %s, want aaaa", p.Name(), got)
		}
	}
	if got := picks(mustPolicy(t, LBRoundRobin), routes, 7); got != "abcabca" {
		t.Errorf("round_robin: %s, want abcabca", got)
	}
	// 300 draws miss one of three agents with probability 3·(2/3)^300.
	got := picks(mustPolicy(t, LBRandom), routes, 300)
	for _, id := range []string{"a", "b", "c"} {
		if !strings.Contains(got, id) {
			t.Errorf("random never chose %s in 300 picks", id)
		}
	}

	lc := mustPolicy(t, LBLeastConn)
	if got := picks(lc, routes, 2); got != "aa" {
		t.Errorf("least_conn with none open: %s, want the first (a)", got)
	}
	routes[0].active.Add(2)
	routes[1].active.Add(1)
	routes[2].active.Add(1)
	if got := lc.pick(routes).agent.agentID; got != "b" {
		t.Errorf("least_conn with a:2 b:1 c:1 open: %s, want b (the first of the fewest)", got)
	}
	routes[1].active.Add(2)
	if got := lc.pick(routes).agent.agentID; got != "c" {
		t.Errorf("least_conn with a:2 b:3 c:1 open: %s, want c", got)
	}

	for _, name := range []string{LBFirst, LBRoundRobin, LBRandom, LBLeastConn} {
		p := mustPolicy(t, name)
		if got := p.pick(routes[1:2]); got != routes[1] {
			t.Errorf("%s with one route: %v", name, got)
		}
		if got := p.pick(nil); got != nil {
			t.Errorf("%s with no route: %v", name, got)
		}
	}
}

// TestLBPolicyNames: every valid name parses to itself; another one is
// refused with the valid names listed.
func TestLBPolicyNames(t *testing.T) {
	for _, name := range []string{LBFirst, LBRoundRobin, LBRandom, LBLeastConn} {
		if got := mustPolicy(t, name).Name(); got != name {
			t.Errorf("NewLBPolicy(%q).Name() = %q", name, got)
		}
	}
	for _, bad := range []string{"fastest", "First", "ip_hash", " first"} {
		_, err := NewLBPolicy(bad)
		if err == nil || !strings.Contains(err.Error(), "round_robin, random, least_conn") {
			t.Errorf("NewLBPolicy(%q) = %v, want an error listing the valid values", bad, err)
		}
	}
}

// TestResolveUnderPolicy: the node resolves a layer4 connection under the
// policy by name, by exact server name, by a server name a pattern route
// serves (among every agent's route of that pattern that covers the name),
// by a layer4 server's port, and a UDP flow by name; first keeps the
// smallest agent id.
func TestResolveUnderPolicy(t *testing.T) {
	n := testNode(t)
	for _, id := range []string{"c", "a", "b"} {
		register(t, n.reg, id,
			&tunnelpb.Route{Name: "svc", Target: "tcp://127.0.0.1:9"},
			&tunnelpb.Route{Name: "dns", Target: "udp://127.0.0.1:9"},
			&tunnelpb.Route{Name: "pass", Host: "db.pass.test", TlsPassthrough: true, Target: "tcp://127.0.0.1:9"},
			&tunnelpb.Route{Name: "wild", HostPattern: `.*\.wild\.test`, TlsPassthrough: true, Target: "tcp://127.0.0.1:9"},
			&tunnelpb.Route{Name: "port", ListenPort: 40001, Target: "tcp://127.0.0.1:9"})
	}
	// A pattern of only one agent, matching the same names: it does not
	// join the others' choice.
	register(t, n.reg, "d", &tunnelpb.Route{Name: "other", HostPattern: `x\.wild\.test`, TlsPassthrough: true, Target: "tcp://127.0.0.1:9"})

	tcp := func(p *LBPolicy, target TCPTarget, times int) string {
		target.LB = p
		var ids []string
		for range times {
			e := n.resolveTCP(target)
			if e == nil {
				t.Fatalf("resolveTCP(%+v) = nil", target)
			}
			ids = append(ids, e.agent.agentID)
		}
		return strings.Join(ids, "")
	}
	targets := map[string]TCPTarget{
		"name":           {Route: "svc"},
		"server name":    {ServerName: "DB.pass.test."},
		"pattern":        {ServerName: "x.wild.test"},
		"name as a host": {Route: "x.wild.test"},
		"layer4 port":    {LocalPort: 40001},
	}
	for what, target := range targets {
		if got := tcp(mustPolicy(t, LBRoundRobin), target, 6); got != "abcabc" {
			t.Errorf("round_robin by %s: %s, want abcabc", what, got)
		}
		if got := tcp(nil, target, 3); got != "aaa" {
			t.Errorf("first by %s: %s, want aaa", what, got)
		}
	}

	rr := mustPolicy(t, LBRoundRobin)
	var ids []string
	for range 4 {
		e := n.resolveUDP(UDPTarget{Route: "dns", LB: rr})
		if e == nil || !e.kind.Datagram() {
			t.Fatalf("resolveUDP = %v, want a udp:// route", e)
		}
		ids = append(ids, e.agent.agentID)
	}
	if got := strings.Join(ids, ""); got != "abca" {
		t.Errorf("round_robin of UDP flows by name: %s, want abca", got)
	}
}

// TestLeastConnAcrossReadvertise: a repeated Advertise (an agent retrying
// its rejected routes) gives the routes new entries; a route it advertises
// again keeps counting the connections opened on its old entry, which end
// there, so least_conn does not take the agent for idle while they run.
func TestLeastConnAcrossReadvertise(t *testing.T) {
	n := testNode(t)
	svc := &tunnelpb.Route{Name: "svc", Target: "tcp://127.0.0.1:9"}
	a := register(t, n.reg, "a", svc)
	register(t, n.reg, "b", svc)
	old := a.routes[0]
	// Two connections run on a, one on b.
	old.conns().Add(2)
	b := n.reg.table.Load().lookupName("svc")[1]
	b.conns().Add(1)

	advertise(t, n.reg, a, svc, &tunnelpb.Route{Name: "other", Target: "tcp://127.0.0.1:9"})
	now := a.routes[0]
	if now == old {
		t.Fatal("the repeated Advertise kept the entry; the test needs a new one")
	}
	if got := now.conns().Load(); got != 2 {
		t.Fatalf("the new entry counts %d connections, want the 2 open on the old one", got)
	}
	lc := mustPolicy(t, LBLeastConn)
	if e := n.resolveTCP(TCPTarget{Route: "svc", LB: lc}); e == nil || e.agent.agentID != "b" {
		t.Fatalf("least_conn chose %v, want b (1 open against a's 2)", e)
	}
	// The old connections end on the old entry: the route's count drops.
	old.conns().Add(-2)
	if got := now.conns().Load(); got != 0 {
		t.Fatalf("after the old connections ended: %d, want 0", got)
	}
	if e := n.resolveTCP(TCPTarget{Route: "svc", LB: lc}); e == nil || e.agent.agentID != "a" {
		t.Fatalf("least_conn chose %v, want a (0 open against b's 1)", e)
	}
}
