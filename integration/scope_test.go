package integration

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

const (
	scopeTokenA = "team-a-token-0123456789abcdef0123"
	scopeTokenB = "team-b-token-0123456789abcdef0123"
)

// scopeCredentials are two named credentials beside the harness's
// unscoped token: team-a serves app.test and *.a.test (and shared.test),
// team-b *.b.test (and shared.test), its listen ports 16000-16009 and
// nothing else.
func scopeCredentials(bHosts string) string {
	return fmt.Sprintf(`credential team-a {
			token %s
			hosts app.test *.a.test shared.test
			patterns
		}
		credential team-b {
			token %s
			hosts %s
			ports 16000-16009
		}`, scopeTokenA, scopeTokenB, bHosts)
}

// routeAcks returns the agent's routes by name: the node's ack and reason.
func routeAcks(a *runningAgent) map[string]agent.RouteStatus {
	out := map[string]agent.RouteStatus{}
	for _, r := range a.Status().Routes {
		out[r.Name] = r
	}
	return out
}

// waitAcked waits until the node answered every route of a.
func waitAcked(t *testing.T, a *runningAgent) map[string]agent.RouteStatus {
	t.Helper()
	var acks map[string]agent.RouteStatus
	testwait.Until(t, 10*time.Second, "the node's answer for every route", func() bool {
		acks = routeAcks(a)
		for _, r := range acks {
			if r.Ack == agent.AckPending {
				return false
			}
		}
		return len(acks) > 0
	})
	return acks
}

// TestScopeRejectsClaimsOutsideIt: an agent of credential team-b gets
// out_of_scope for a host, a pattern, a TLS server name, a named service,
// a port and the catch-all outside its scope, each route alone; the route
// inside its scope serves.
func TestScopeRejectsClaimsOutsideIt(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: scopeCredentials("*.b.test shared.test"), CaptureLog: true}, siteAll)
	up := startUpstream(t, "b")
	b := launchAgent(t, c.serverURL(), "0-evil", scopeTokenB,
		agent.Upstream{Name: "mine", Host: "x.b.test", Target: up},
		agent.Upstream{Name: "host", Host: "app.test", Target: up},
		agent.Upstream{Name: "pattern", HostPattern: `.*`, Target: up},
		agent.Upstream{Name: "sni", Host: "db.b.test", TLSPassthrough: true, Target: "tcp://127.0.0.1:1"},
		agent.Upstream{Name: "redis", Target: "tcp://127.0.0.1:1"},
		agent.Upstream{Name: "port-in", ListenPort: 16001, Target: "tcp://127.0.0.1:1"},
		agent.Upstream{Name: "port-out", ListenPort: 17000, Target: "tcp://127.0.0.1:1"},
		agent.Upstream{Name: "*", Target: up},
	)
	waitConnected(t, b)
	acks := waitAcked(t, b)
	for name, want := range map[string]string{
		"mine": "", "port-in": "",
		"host":     `out_of_scope: host "app.test" is not among its hosts of credential "team-b"`,
		"pattern":  "out_of_scope: host patterns are not allowed",
		"sni":      `out_of_scope: TLS server name "db.b.test"`,
		"redis":    `out_of_scope: TCP service "redis"`,
		"port-out": "out_of_scope: listen port 17000 is outside its ports 16000-16009",
		"*":        "out_of_scope: the catch-all route is not allowed",
	} {
		r, ok := acks[name]
		switch {
		case !ok:
			t.Errorf("route %q missing from the agent's status", name)
		case want == "" && r.Ack != agent.AckAccepted:
			t.Errorf("route %q: %s %q, want accepted", name, r.Ack, r.Reason)
		case want != "" && (r.Ack != agent.AckRejected || !strings.HasPrefix(r.Reason, "out_of_scope") || !strings.Contains(r.Reason, want)):
			t.Errorf("route %q: %s %q, want rejected with %q", name, r.Ack, r.Reason, want)
		}
	}
	if code, body := get(t, c, "x.b.test", "/"); code != 200 || !strings.Contains(body, "Hello from b") {
		t.Errorf("x.b.test: %d %q", code, body)
	}
	if code, _ := get(t, c, "app.test", "/"); code == 200 {
		t.Error("app.test served by an agent whose scope does not have it")
	}
	testwait.Until(t, 10*time.Second, "the node's log of the rejections", func() bool {
		return len(c.logLines(t, "agent route outside its credential's scope rejected")) > 0
	})
}

// TestCredentialsNamespaceAgentIDs: an agent of team-b with the id of
// team-a's agent does not displace it, while two agents of team-a with
// one id still do.
func TestCredentialsNamespaceAgentIDs(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: scopeCredentials("*.b.test shared.test")}, siteAll)
	upA, upB := startUpstream(t, "a"), startUpstream(t, "b")
	a := launchAgent(t, c.serverURL(), "agent-1", scopeTokenA, agent.Upstream{Host: "app.test", Target: upA})
	waitConnected(t, a)
	b := launchAgent(t, c.serverURL(), "agent-1", scopeTokenB, agent.Upstream{Host: "x.b.test", Target: upB})
	waitConnected(t, b)
	for host, want := range map[string]string{"app.test": "Hello from a", "x.b.test": "Hello from b"} {
		if code, body := get(t, c, host, "/"); code != 200 || !strings.Contains(body, want) {
			t.Errorf("%s: %d %q, want %q", host, code, body, want)
		}
	}
	if got := a.Status().Sessions[0].Established; got != 1 {
		t.Errorf("team-a's agent-1 established %d sessions, want 1 (it was displaced)", got)
	}

	// A second team-a agent-1 replaces the first, as one credential's
	// agents always did.
	upA2 := startUpstream(t, "a2")
	a2 := launchAgent(t, c.serverURL(), "agent-1", scopeTokenA, agent.Upstream{Host: "app.test", Target: upA2})
	waitConnected(t, a2)
	testwait.Until(t, 10*time.Second, "team-a's first agent-1 replaced", func() bool {
		_, body := get(t, c, "app.test", "/")
		return strings.Contains(body, "Hello from a2") && strings.Contains(a.Status().Sessions[0].LastError, "replaced")
	})
	if got := b.Status().Sessions[0].Established; got != 1 {
		t.Errorf("team-b's agent-1 established %d sessions, want 1", got)
	}
}

// TestOverlappingScopesAreToldAndLogged: when agents of two credentials
// serve one host, both are told in their AdvertiseAck which of them comes
// first, and the node logs the shadowed one; when one leaves, the other is
// told the overlap ended.
func TestOverlappingScopesAreToldAndLogged(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: scopeCredentials("*.b.test shared.test"), CaptureLog: true}, siteAll)
	upA, upB := startUpstream(t, "a"), startUpstream(t, "b")
	a := launchAgent(t, c.serverURL(), "agent-a", scopeTokenA, agent.Upstream{Host: "shared.test", Target: upA})
	waitConnected(t, a)
	// "0-b" sorts before "agent-a": team-b's agent comes first.
	b := launchAgent(t, c.serverURL(), "0-b", scopeTokenB, agent.Upstream{Host: "shared.test", Target: upB})
	waitConnected(t, b)
	testwait.Until(t, 10*time.Second, "both agents told of the overlap", func() bool {
		oa, ob := overlapsOf(a), overlapsOf(b)
		return len(oa) == 1 && oa[0].Shadowed && oa[0].OtherCredential == "team-b" && oa[0].OtherAgentID == "0-b" &&
			len(ob) == 1 && !ob[0].Shadowed && ob[0].OtherCredential == "team-a" && ob[0].OtherAgentID == "agent-a"
	})
	if code, body := get(t, c, "shared.test", "/"); code != 200 || !strings.Contains(body, "Hello from b") {
		t.Errorf("shared.test: %d %q, want team-b's agent (first in routing order)", code, body)
	}
	testwait.Until(t, 10*time.Second, "the node's log of the shadowed route", func() bool {
		for _, line := range c.logLines(t, "route served by agents of two credentials: the first in routing order shadows the other") {
			if strings.Contains(string(line), `"shadowed_by_credential":"team-b"`) && strings.Contains(string(line), `"credential":"team-a"`) {
				return true
			}
		}
		return false
	})
	b.stop()
	testwait.Until(t, 10*time.Second, "team-a's agent told the overlap ended", func() bool {
		return len(overlapsOf(a)) == 0
	})
}

// TestReloadAppliesScopesAndCredentials: a reload that narrows a
// credential's scope rejects its agent's route (out_of_scope) without a
// reconnect; one that removes the credential ends the session, and the
// agent is refused from then on.
func TestReloadAppliesScopesAndCredentials(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: scopeCredentials("*.b.test shared.test")}, siteAll)
	up := startUpstream(t, "b")
	b := launchAgent(t, c.serverURL(), "agent-b", scopeTokenB,
		agent.Upstream{Name: "shared", Host: "shared.test", Target: up},
		agent.Upstream{Name: "mine", Host: "x.b.test", Target: up})
	waitConnected(t, b)
	if code, _ := get(t, c, "shared.test", "/"); code != 200 {
		t.Fatalf("shared.test before the reload: %d", code)
	}

	c.opts.Sluice = scopeCredentials("*.b.test")
	c.load(siteAll)
	testwait.Until(t, 10*time.Second, "shared.test rejected after the scope narrowed", func() bool {
		r := routeAcks(b)["shared"]
		return r.Ack == agent.AckRejected && strings.HasPrefix(r.Reason, "out_of_scope")
	})
	if code, _ := get(t, c, "shared.test", "/"); code == 200 {
		t.Error("shared.test still served after the reload took it out of scope")
	}
	if code, _ := get(t, c, "x.b.test", "/"); code != 200 {
		t.Errorf("x.b.test after the reload: %d", code)
	}
	if got := b.Status().Sessions[0].Established; got != 1 {
		t.Errorf("the agent reconnected (%d sessions) for a scope change", got)
	}

	c.opts.Sluice = fmt.Sprintf(`credential team-a {
			token %s
			hosts app.test
		}`, scopeTokenA)
	c.load(siteAll)
	testwait.Until(t, 10*time.Second, "team-b's session ended", func() bool {
		return b.Status().Sessions[0].State != "connected"
	})
	r0 := b.Status().Sessions[0].Reconnects
	testwait.Until(t, 10*time.Second, "two more attempts refused", func() bool {
		s := b.Status().Sessions[0]
		return s.Reconnects >= r0+2 && strings.Contains(s.LastError, "credential")
	})
	if s := b.Status().Sessions[0]; s.Established != 1 {
		t.Errorf("the agent of a removed credential connected again (%d sessions, last error %q)", s.Established, s.LastError)
	}
}

// overlapsOf returns what the node last told a of routes it shares with
// agents of other credentials.
func overlapsOf(a *runningAgent) []agent.OverlapStatus {
	s := a.Status().Sessions
	if len(s) == 0 {
		return nil
	}
	return s[0].Overlaps
}
