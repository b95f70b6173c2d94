package integration

import (
	"fmt"
	"strings"
	"testing"

	"github.com/sluice-tunnel/sluice/agent"
)

// TestTLSControlPlane: with `tls <cert> <key>` in the sluice block the
// control plane serves grpcs://, an agent that trusts the certificate
// (ca_file) connects over TLS, and requests reach its upstream.
func TestTLSControlPlane(t *testing.T) {
	openssl := needCommand(t, "openssl")
	certFile, keyFile, _ := selfSignedCert(t, openssl, "sluice-node", "localhost,IP:127.0.0.1")
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("tls %s %s", certFile, keyFile)}, siteAll)
	up := startUpstream(t, "tls-app")
	serverURL := strings.Replace(c.serverURL(), "grpc://", "grpcs://", 1)
	startAgentWith(t, serverURL, "tls-agent", func(cfg *agent.Config) { cfg.CAFile = certFile },
		agent.Upstream{Host: "app.test", Target: up})

	code, body := get(t, c, "app.test", "/")
	if code != 200 || !strings.Contains(body, "tls-app") {
		t.Fatalf("GET through a TLS control plane: %d %q", code, body)
	}
}
