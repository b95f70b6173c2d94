package integration

import (
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Direct sockets (proto/README §2.5): a connection that carried 1 MiB
// moves off the data lane to a socket of its own. Every test with a larger
// body runs through one; these check that it happens, over plaintext and
// TLS, that either end can turn it off, and that the door is shut to
// strangers.

// TestBulkConnectionsGoDirect: a download and an upload through Caddy move
// to direct sockets and arrive intact; small requests on the same agent
// stay on the lane.
func TestBulkConnectionsGoDirect(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a, logs := launchAgentObserved(t, c.serverURL(), "direct-agent", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "direct-agent", "direct_sockets", true)

	if code, _ := get(t, c, "app.test", "/"); code != 200 || a.Stats().Direct != 0 {
		t.Fatalf("small GET: %d, direct sockets %d; want 200 on the lane", code, a.Stats().Direct)
	}
	checkDownload(t, c, "app.test", 64<<20)
	if n := a.Stats().Direct; n < 1 {
		t.Fatalf("a 64 MiB download went through %d direct sockets; want one", n)
	}
	checkUpload(t, c, "app.test", 16<<20)
	// What came after a move on a reused connection still works.
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "app") {
		t.Fatalf("GET after the bulk transfers: %d %q", code, body)
	}
}

// checkUpload posts size bytes to the upstream's /upload, which answers
// the count and checksum of what it read.
func checkUpload(t testing.TB, c *caddyServer, host string, size int64) {
	t.Helper()
	h := sha256.New()
	io.Copy(h, sampleupstream.Pattern(size))
	want := fmt.Sprintf("%d %x\n", size, h.Sum(nil))
	req, _ := http.NewRequest("POST", c.url("/upload"), sampleupstream.Pattern(size))
	req.Host = host
	req.ContentLength = size
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || string(got) != want {
		t.Fatalf("upload: status %d, answer %q, err %v; want %q", resp.StatusCode, got, err, want)
	}
}

// TestDirectSocketsOverTLS: with a TLS control plane the direct socket
// runs the same TLS handshake as the lane, and a download through it
// arrives intact.
func TestDirectSocketsOverTLS(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option()}, siteAll)
	up := startUpstream(t, "tls-app")
	serverURL := grpcsURL(c)
	a, _ := launchAgentLogged(t, serverURL, "tls-direct", testToken, tn.trust,
		false, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	checkDownload(t, c, "app.test", 32<<20)
	checkUpload(t, c, "app.test", 8<<20)
	if n := a.Stats().Direct; n < 1 {
		t.Fatalf("bulk transfers over a TLS control plane went through %d direct sockets; want some", n)
	}
}

// TestDirectSocketsOff: the node's `direct_sockets off` and the agent's
// disable_direct_sockets each keep every connection on the lane.
func TestDirectSocketsOff(t *testing.T) {
	cases := []struct {
		name   string
		global string
		adjust func(*agent.Config)
	}{
		{"node direct_sockets off", "direct_sockets off", nil},
		{"agent disable_direct_sockets", "", func(cfg *agent.Config) { cfg.DisableDirectSockets = true }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := startCaddyWith(t, caddyOptions{Sluice: tc.global, CaptureLog: true}, siteAll)
			up := startUpstream(t, "app")
			a, logs := launchAgentLogged(t, c.serverURL(), "lane-only", testToken, tc.adjust, true,
				agent.Upstream{Host: "app.test", Target: up})
			waitConnected(t, a)
			assertConnectedSays(t, c, logs, "lane-only", "data_lane", true)
			checkDownload(t, c, "app.test", 16<<20)
			if n := a.Stats().Direct; n != 0 {
				t.Fatalf("%d direct sockets; want none", n)
			}
		})
	}
}

// TestDirectSocketRefusesStrangers: a direct socket preface with a key no
// session has, or naming a connection that is not open, is closed without
// the node's 0x01, and the node goes on serving.
func TestDirectSocketRefusesStrangers(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a := launchAgent(t, c.serverURL(), "direct-strangers", testToken, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	addr := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	for _, hello := range [][]byte{
		tunnelpb.DirectHello(strings.Repeat("ab", tunnelpb.DirectKeyLength/2), 2),
		[]byte(tunnelpb.DirectPreface + strings.Repeat("0", tunnelpb.DirectKeyLength) + "not-hex-digits!!\n"),
	} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write(hello); err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || len(got) != 0 {
			t.Errorf("direct preface %q: read %q, %v; want the connection closed with nothing", hello, got, err)
		}
	}
	eventually(t, 5*time.Second, `"direct socket refused" logged`, func() bool {
		return len(c.logLines(t, "direct socket refused")) > 0
	})
	checkDownload(t, c, "app.test", 8<<20)
}
