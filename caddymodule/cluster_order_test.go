package caddymodule

import (
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Every node of a cluster sees every agent, in whatever order they
// happened to connect to it: what a node decides must follow from the set
// of agents alone, or two nodes would serve one host from different
// agents. These tests register the same agents in both orders.

// orders runs fn for each order of two agents' arrival.
func orders(t *testing.T, fn func(t *testing.T, first, second string)) {
	for _, o := range [][2]string{{"agent-a", "agent-b"}, {"agent-b", "agent-a"}} {
		t.Run(o[0]+"_first", func(t *testing.T) { fn(t, o[0], o[1]) })
	}
}

// admitRoutes admits and registers routes for a on n, as a first
// Advertise is.
func admitRoutes(n *node, a *agentSession, routes ...*tunnelpb.Route) []*tunnelpb.RejectedRoute {
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	entries, rejected := n.admit(a, routes, nil)
	a.advertised = routes
	n.reg.register(a, entries)
	return rejected
}

// TestRoutingIgnoresArrivalOrder: an HTTP host, a TLS server name (exact
// and by pattern), a named TCP service and a port served by layer4 go to
// the smallest agent id whichever agent registered first, with the other
// next in line.
func TestRoutingIgnoresArrivalOrder(t *testing.T) {
	routes := []*tunnelpb.Route{
		{Name: "web", Host: "app.test", Target: "http://127.0.0.1:1"},
		{Name: "db", Host: "db.test", TlsPassthrough: true, Target: "tcp://127.0.0.1:2"},
		{Name: "wild", HostPattern: `[a-z]+\.wild\.test`, TlsPassthrough: true, Target: "tcp://127.0.0.1:3"},
		{Name: "redis", Target: "tcp://127.0.0.1:4"},
		{Name: "ssh", ListenPort: 2222, Target: "tcp://127.0.0.1:5"},
	}
	orders(t, func(t *testing.T, first, second string) {
		n := testNode(t) // no tcp_port_range: port routes are layer4's
		for _, id := range []string{first, second} {
			if rejected := admitRoutes(n, &agentSession{agentID: id}, routes...); len(rejected) > 0 {
				t.Fatalf("%s: rejected %v", id, rejected)
			}
		}
		tab := n.reg.table.Load()
		for what, got := range map[string]string{
			"HTTP host":           agentsOf(tab.lookupHTTP("app.test")),
			"named service":       agentsOf(tab.lookupName("redis")),
			"server name":         agentsOf(tab.lookupSNI("db.test")),
			"layer4 port":         agentsOf(tab.byPort.get(2222)),
			"server name pattern": agentsOf(tab.lookupSNI("x.wild.test")),
		} {
			want := "agent-a:" + map[string]string{"HTTP host": "web", "named service": "redis", "server name": "db",
				"layer4 port": "ssh", "server name pattern": "wild"}[what]
			if what != "server name pattern" { // lookupSNI keeps the first pattern route alone
				want += ",agent-b" + want[len("agent-a"):]
			}
			if got != want {
				t.Errorf("%s: %s, want %s", what, got, want)
			}
		}
		for _, target := range []TCPTarget{{Route: "redis"}, {ServerName: "db.test"}, {ServerName: "x.wild.test"}, {LocalPort: 2222}} {
			if e := n.resolveTCP(target); e == nil || e.agent.agentID != "agent-a" {
				t.Errorf("resolveTCP(%+v) = %v, want agent-a's route", target, e)
			}
		}
	})
}

// TestCredentialBreaksTiesWhateverTheOrder: one agent id under two
// credentials is ordered by credential name, whichever registered first.
func TestCredentialBreaksTiesWhateverTheOrder(t *testing.T) {
	for _, o := range [][2]string{{"team-a", "team-b"}, {"team-b", "team-a"}} {
		t.Run(o[0]+"_first", func(t *testing.T) {
			n := testNode(t)
			for _, cred := range o {
				admitRoutes(n, &agentSession{agentID: "agent", credName: cred}, &tunnelpb.Route{Name: "web", Host: "app.test", Target: "http://127.0.0.1:1"})
			}
			got := n.reg.table.Load().lookupHTTP("app.test")
			if len(got) != 2 || got[0].agent.credName != "team-a" || got[1].agent.credName != "team-b" {
				t.Fatalf("app.test served by %v, want team-a's agent, then team-b's", got)
			}
		})
	}
}

// TestPortOwnerIgnoresArrivalOrder: a port the node binds goes to the
// smallest agent id, also when it arrives after a larger one holds the
// port (it takes the port over). What the larger one is told differs by
// order (a standby when it came first, a rejected route when it came
// second, which its agent retries with backoff), never who serves; when
// the owner leaves, the larger id serves the port in both orders (at
// once as the standby, after its retry otherwise).
func TestPortOwnerIgnoresArrivalOrder(t *testing.T) {
	orders(t, func(t *testing.T, first, second string) {
		n, port := portTestNode(t)
		sessions := map[string]*agentSession{}
		for _, id := range []string{first, second} {
			s, _ := testSessionPair(t)
			sessions[id] = &agentSession{agentID: id, sess: s}
			advertisePort(n, sessions[id], port)
			if id == first {
				if o := n.ports.owner(port); o == nil || o.agent.agentID != first {
					t.Fatalf("owner %v once %s claimed the port alone", o, first)
				}
			}
		}
		if o := n.ports.owner(port); o == nil || o.agent.agentID != "agent-a" {
			t.Fatalf("owner %v, want agent-a", o)
		}
		if e := n.resolveTCP(TCPTarget{LocalPort: port}); e == nil || e.agent.agentID != "agent-a" {
			t.Fatalf("connections to the port go to %v, want agent-a", e)
		}

		// agent-a's session ends; agent-b's agent, if it was refused,
		// retries its Advertise.
		a := sessions["agent-a"]
		n.admitMu.Lock()
		n.reg.unregister(a)
		n.releasePorts(a.currentRoutes(&n.reg.mu))
		n.admitMu.Unlock()
		if n.ports.owner(port) == nil {
			advertisePort(n, sessions["agent-b"], port)
		}
		if o := n.ports.owner(port); o == nil || o.agent.agentID != "agent-b" {
			t.Fatalf("owner after agent-a left: %v, want agent-b", o)
		}
	})
}
