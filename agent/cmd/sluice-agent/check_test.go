package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/sluice-tunnel/sluice/agent"
)

// TestWriteCheckReport: a line per node and per route, the rejected
// route named with its port and the node's reason, a port the running
// agent of the id holds as held, an unreachable node with why.
func TestWriteCheckReport(t *testing.T) {
	var b bytes.Buffer
	writeCheckReport(&b, agent.CheckResult{AgentID: "web-check-1", Nodes: []agent.NodeCheck{
		{Server: "grpc://a:8001", NodeID: "n1", NodeBuild: "sluice-node v1 (go1.26)",
			Accepted:    []string{"app.example.com"},
			Rejected:    []agent.RejectedRoute{{Name: "redis", ListenPort: 17000, Reason: "port 17000 is outside tcp_port_range 16000-16999"}},
			HeldByAgent: []agent.RejectedRoute{{Name: ":16000", ListenPort: 16000, Reason: "port 16000 is held by agent web"}},
			Overlaps:    []agent.RouteOverlap{{Route: "app.example.com", OtherCredential: "team-b", OtherAgentID: "x", Shadowed: true}}},
		{Server: "grpc://b:8001", Err: errors.New("node not reached: authentication failed")},
	}})
	want := `checked as agent id web-check-1
node n1 at grpc://a:8001 (sluice-node v1 (go1.26)), credential (token): 1 accepted, 1 rejected
  accepted  app.example.com
  rejected  redis (listen_port 17000): port 17000 is outside tcp_port_range 16000-16999
  held      :16000: port 16000 is held by agent web (the running agent of this id serves it)
  overlap   app.example.com: also served by agent x of credential team-b; that agent comes first in routing order (this one is shadowed)
server grpc://b:8001: not reached: node not reached: authentication failed
`
	if got := b.String(); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

// TestRunCheckExitCodes: an invalid configuration exits 2 before any
// dial; -h prints the check's help with its exit codes, and exits 0.
func TestRunCheckExitCodes(t *testing.T) {
	noEnv := func(string) string { return "" }
	var out, errOut bytes.Buffer
	if code := runCheck([]string{"-server", "grpc://127.0.0.1:1"}, &out, &errOut, noEnv); code != exitConfig ||
		!strings.Contains(errOut.String(), "token") || out.Len() != 0 {
		t.Errorf("no token: exit %d, stdout %q, stderr %q", code, out.String(), errOut.String())
	}
	out.Reset()
	errOut.Reset()
	if code := runCheck([]string{"-h"}, &out, &errOut, noEnv); code != 0 ||
		!strings.HasPrefix(out.String(), "Usage: sluice-agent check [flags]") || !strings.Contains(out.String(), "  4  a node rejected a route") ||
		strings.Contains(out.String(), "Usage: sluice-agent [flags]") {
		t.Errorf("-h: exit %d, stdout %q", code, out.String())
	}
}
