package integration

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest/observer"

	"github.com/sluice-tunnel/sluice/agent"
)

// TestTLSControlPlane: with `tls <cert> <key>` in the sluice block the
// control plane serves grpcs://, an agent that trusts the certificate
// (ca_file) connects over TLS, and requests reach its upstream. Both ends'
// stall watchdogs read the TLS connection's socket progress.
func TestTLSControlPlane(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option(), CaptureLog: true}, siteAll)
	up := startUpstream(t, "tls-app")
	serverURL := grpcsURL(c)
	a, logs := launchAgentLogged(t, serverURL, "tls-agent", testToken, tn.trust,
		true, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)

	code, body := get(t, c, "app.test", "/")
	if code != 200 || !strings.Contains(body, "tls-app") {
		t.Fatalf("GET through a TLS control plane: %d %q", code, body)
	}
	assertStallProgress(t, c, logs, "tls-agent")
}

// TestStallWatchdogReadsTheSocket: over a plaintext control plane too, the
// node's and the agent's sessions get the socket's progress (their
// "connected" lines say stall_progress).
func TestStallWatchdogReadsTheSocket(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a, logs := launchAgentObserved(t, c.serverURL(), "progress-agent", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertStallProgress(t, c, logs, "progress-agent")
}

// assertStallProgress checks the node's "agent connected" line for id and
// the agent's "connected" line both report stall_progress true, and that
// the session runs on the data lane (data_lane true; proto/README §2.4).
func assertStallProgress(t *testing.T, c *caddyServer, agentLogs *observer.ObservedLogs, id string) {
	t.Helper()
	assertConnectedSays(t, c, agentLogs, id, "stall_progress", true)
	assertConnectedSays(t, c, agentLogs, id, "data_lane", true)
}

// assertConnectedSays checks that the node's "agent connected" line for id
// and the agent's first "connected" line both have field = want.
func assertConnectedSays(t *testing.T, c *caddyServer, agentLogs *observer.ObservedLogs, id, field string, want bool) {
	t.Helper()
	var nodeSaid *bool
	eventually(t, 5*time.Second, "the node's agent connected line", func() bool {
		nodeSaid = nodeConnectedSays(t, c, id, field)
		return nodeSaid != nil
	})
	if *nodeSaid != want {
		t.Errorf(`node: "agent connected" says %s %v, want %v`, field, *nodeSaid, want)
	}
	lines := agentLogs.FilterMessage("connected").All()
	if len(lines) == 0 {
		t.Fatal(`agent logged no "connected" line`)
	}
	if got, ok := lines[0].ContextMap()[field].(bool); !ok || got != want {
		t.Errorf(`agent: "connected" has %s %v, want %v`, field, lines[0].ContextMap()[field], want)
	}
}

// nodeConnectedSays returns the boolean field of the node's "agent
// connected" line for agent id, or nil while there is none.
func nodeConnectedSays(t *testing.T, c *caddyServer, id, field string) *bool {
	for _, line := range c.logLines(t, "agent connected") {
		var l map[string]any
		if err := json.Unmarshal(line, &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if v, ok := l[field].(bool); ok && l["agent"] == id {
			return &v
		}
	}
	return nil
}

// TestTLSControlPlaneReload: a reload that names a renewed certificate
// serves it to new agent connections without dropping the connected agent,
// and a reload that would turn TLS off for a listening control plane is
// refused with the field named, the running config going on.
func TestTLSControlPlaneReload(t *testing.T) {
	openssl := needCommand(t, "openssl")
	certA, keyA, _ := selfSignedCert(t, openssl, "sluice-node-a", "localhost,IP:127.0.0.1")
	certB, keyB, derB := selfSignedCert(t, openssl, "sluice-node-b", "localhost,IP:127.0.0.1")
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("tls %s %s", certA, keyA)}, siteAll)
	up := startUpstream(t, "tls-app")
	serverURL := grpcsURL(c)
	a := startAgentWith(t, serverURL, "tls-agent", func(cfg *agent.Config) { cfg.CAFile = certA },
		agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	sessions := a.Sessions()

	c.opts.Sluice = fmt.Sprintf("tls %s %s", certB, keyB)
	c.load(siteAll)
	if got := controlPlaneLeaf(t, c); !bytes.Equal(got, derB) {
		t.Fatal("after the reload the control plane still serves the old certificate")
	}
	if a.Sessions() != sessions || a.State() != agent.StateConnected {
		t.Fatalf("the certificate reload reconnected the agent: sessions %d→%d, state %v", sessions, a.Sessions(), a.State())
	}
	if code, body := getAfterReload(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "tls-app") {
		t.Fatalf("GET after the certificate reload: %d %q", code, body)
	}

	c.opts.Sluice = ""
	err := c.tryLoadGlobal(c.opts.Global, siteAll)
	if err == nil || !strings.Contains(err.Error(), "tls_cert_file") || !strings.Contains(err.Error(), "already listening with TLS") {
		t.Fatalf("a reload turning TLS off: got %v, want an error naming tls_cert_file", err)
	}
	if got := controlPlaneLeaf(t, c); !bytes.Equal(got, derB) {
		t.Fatal("the refused reload changed the served certificate")
	}
	if code, _ := get(t, c, "app.test", "/"); code != 200 || a.Sessions() != sessions {
		t.Fatalf("after the refused reload: GET %d, agent sessions %d→%d", code, sessions, a.Sessions())
	}
}

// controlPlaneLeaf is the DER certificate the control plane serves to a new
// TLS connection.
func controlPlaneLeaf(t *testing.T, c *caddyServer) []byte {
	t.Helper()
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp",
		fmt.Sprintf("127.0.0.1:%d", c.controlPort), &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatalf("TLS to the control plane: %v", err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].Raw
}

// TestConnectionErrorsSayWhatToCheck: an agent given a wrong server setting
// logs, beside gRPC's wording, what to check: grpc:// against a TLS control
// plane, grpcs:// without trusting its certificate, Caddy's HTTP site port
// instead of the control plane's, and grpcs:// against a plaintext port.
func TestConnectionErrorsSayWhatToCheck(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option()}, siteAll)
	site := fmt.Sprintf("127.0.0.1:%d", c.httpPort)
	for _, tc := range []struct{ name, server, hint string }{
		{"plaintext to TLS", c.serverURL(), "use grpcs://"},
		{"untrusted certificate", grpcsURL(c), "ca_file"},
		{"the HTTP site's port", "grpc://" + site, "not as a sluice control plane"},
		{"TLS to plaintext", "grpcs://" + site, "does not speak TLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, logs := launchAgentLogged(t, tc.server, "misdirected", testToken, nil, true, agent.Upstream{Host: "app.test", Target: "http://127.0.0.1:9"})
			eventually(t, 10*time.Second, "a failed attempt logged with its hint", func() bool {
				for _, e := range logs.FilterMessage("connection failed; retrying").All() {
					if h, _ := e.ContextMap()["hint"].(string); strings.Contains(h, tc.hint) {
						return true
					}
				}
				return false
			})
		})
	}
}

// tlsNode is the TLS of a control plane on 127.0.0.1: a self-signed
// certificate's files (the test is skipped without openssl).
type tlsNode struct{ cert, key string }

func newTLSNode(t *testing.T) tlsNode {
	openssl := needCommand(t, "openssl")
	cert, key, _ := selfSignedCert(t, openssl, "sluice-node", "localhost,IP:127.0.0.1")
	return tlsNode{cert: cert, key: key}
}

// option is the sluice global option's body with this TLS, then extra lines.
func (n tlsNode) option(extra ...string) string {
	s := fmt.Sprintf("tls %s %s", n.cert, n.key)
	for _, line := range extra {
		if line != "" {
			s += "\n\t\t" + line
		}
	}
	return s
}

// trust makes an agent trust the node's certificate.
func (n tlsNode) trust(cfg *agent.Config) { cfg.CAFile = n.cert }

// grpcsURL is c's control plane address for an agent over TLS.
func grpcsURL(c *caddyServer) string { return strings.Replace(c.serverURL(), "grpc://", "grpcs://", 1) }
