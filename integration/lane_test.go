package integration

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The data lane (proto/README §2.4): every other test's agent runs its
// session on a lane (TestStallWatchdogReadsTheSocket and
// TestTLSControlPlane check that it does); these check the ways a session
// stays on the gRPC stream, and that the lane's door is shut to strangers.

// laneOffTests runs one body per way of keeping a session off the lane,
// each with the agent's logs and the data_lane both ends must report.
func TestSessionWithoutDataLane(t *testing.T) {
	cases := []struct {
		name   string
		global string
		adjust func(*agent.Config)
	}{
		{"node data_lane off", "data_lane off", nil},
		{"agent disable_data_lane", "", func(cfg *agent.Config) { cfg.DisableDataLane = true }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := startCaddyWith(t, caddyOptions{Sluice: tc.global, CaptureLog: true}, siteAll)
			up := startUpstream(t, "app")
			a, logs := launchAgentLogged(t, c.serverURL(), "grpc-only", testToken, tc.adjust, true,
				agent.Upstream{Host: "app.test", Target: up})
			waitConnected(t, a)
			assertConnectedSays(t, c, logs, "grpc-only", "data_lane", false)
			if n := logs.FilterMessageSnippet("data lane unavailable").Len(); n != 0 {
				t.Errorf("the agent tried a lane %d times", n)
			}
			checkDownload(t, c, "app.test", 32<<20)
		})
	}
}

// TestLaneThatCannotOpenFallsBack: between the agent and the node sits a
// forwarder that passes only the first connection (the gRPC one), as a
// load balancer that speaks only gRPC would refuse the lane. The agent
// says once that the lane is unavailable and serves on the gRPC stream.
func TestLaneThatCannotOpenFallsBack(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	fwd := firstConnOnly(t, fmt.Sprintf("127.0.0.1:%d", c.controlPort))
	a, logs := launchAgentLogged(t, "grpc://"+fwd, "behind-lb", testToken, nil, true,
		agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "behind-lb", "data_lane", false)
	if n := logs.FilterMessageSnippet("data lane unavailable").Len(); n != 1 {
		t.Errorf(`agent logged "data lane unavailable" %d times, want 1`, n)
	}
	checkDownload(t, c, "app.test", 32<<20)
}

// firstConnOnly forwards the first connection to target and closes every
// later one at once; it returns its address.
func firstConnOnly(t testing.TB, target string) string {
	return connsUpTo(t, target, 1, new(atomic.Int32))
}

// TestLaneRefusesStrangers: a lane preface with a ticket no stream is
// waiting for, a malformed one, and one that never finishes are each
// closed without the node's 0x01, logged, and leave the control plane
// serving agents.
func TestLaneRefusesStrangers(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	addr := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	for _, hello := range []string{
		tunnelpb.LanePreface + strings.Repeat("ab", tunnelpb.LaneTicketLength/2) + "\n",
		"SLUICE-LANE/2 " + strings.Repeat("0", tunnelpb.LaneTicketLength) + "\n",
		"S",
	} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write([]byte(hello)); err != nil {
			t.Fatal(err)
		}
		if hello == "S" {
			conn.(*net.TCPConn).CloseWrite() // the rest never comes
		}
		conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || len(got) != 0 {
			t.Errorf("lane preface %q: read %q, %v; want the connection closed with nothing", hello, got, err)
		}
	}
	eventually(t, 5*time.Second, `"data lane refused" logged`, func() bool {
		return len(c.logLines(t, "data lane refused")) > 0
	})

	up := startUpstream(t, "app")
	a, logs := launchAgentLogged(t, c.serverURL(), "after-strangers", testToken, nil, true,
		agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "after-strangers", "data_lane", true)
}

// TestReloadTurnsTheLaneOffForNewSessionsOnly: `caddy reload` with
// data_lane off keeps the running agent's lane session (no reconnect, a
// download through it intact) and a new agent connects on the gRPC stream.
func TestReloadTurnsTheLaneOffForNewSessionsOnly(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	first, firstLogs := launchAgentLogged(t, c.serverURL(), "before-reload", testToken, nil, true,
		agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, first)
	assertConnectedSays(t, c, firstLogs, "before-reload", "data_lane", true)
	sessions := first.Sessions()

	c.opts.Sluice = "data_lane off"
	reloadWithNewSite(t, c, siteAll)

	second, secondLogs := launchAgentLogged(t, c.serverURL(), "after-reload", testToken, nil, true,
		agent.Upstream{Host: "other.test", Target: up})
	waitConnected(t, second)
	assertConnectedSays(t, c, secondLogs, "after-reload", "data_lane", false)
	checkDownload(t, c, "app.test", 16<<20)
	checkDownload(t, c, "other.test", 16<<20)
	if first.Sessions() != sessions || first.State() != agent.StateConnected {
		t.Fatalf("the reload reconnected the lane agent: sessions %d -> %d, state %v", sessions, first.Sessions(), first.State())
	}
}

// TestTLSLaneThatCannotOpenFallsBack is TestLaneThatCannotOpenFallsBack
// over grpcs://: the lane's TLS handshake meets a closed connection.
func TestTLSLaneThatCannotOpenFallsBack(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option(), CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	fwd := firstConnOnly(t, fmt.Sprintf("127.0.0.1:%d", c.controlPort))
	a, logs := launchAgentLogged(t, "grpcs://"+fwd, "tls-behind-lb", testToken, tn.trust,
		true, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "tls-behind-lb", "data_lane", false)
	if n := logs.FilterMessageSnippet("data lane unavailable").Len(); n != 1 {
		t.Errorf(`agent logged "data lane unavailable" %d times, want 1`, n)
	}
	checkDownload(t, c, "app.test", 16<<20)
}
