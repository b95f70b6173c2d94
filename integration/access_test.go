package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/logging" // log_append, for the placeholders
	"github.com/coder/websocket"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// jsonLines parses the JSON lines of the log file at path whose msg is
// msg (every line when msg is empty).
func jsonLines(t testing.TB, path, msg string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("reading %s: %v", path, err)
	}
	var out []map[string]any
	for _, line := range bytes.Split(b, []byte("\n")) {
		var m map[string]any
		if json.Unmarshal(line, &m) != nil {
			continue
		}
		if msg == "" || m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// TestAccessPlaceholdersInCaddyAccessLog: a site's own access log, with
// log_append, names the agent, route and transport that served a request
// through the tunnel.
func TestAccessPlaceholdersInCaddyAccessLog(t *testing.T) {
	accessLog := filepath.Join(t.TempDir(), "access.log")
	site := fmt.Sprintf(`http://:{HTTP} {
	log {
		output sluice_test_file %s
	}
	log_append sluice_agent {http.sluice.agent}
	log_append sluice_route {http.sluice.route}
	log_append sluice_transport {http.sluice.transport}
	sluice
}`, accessLog)
	c := startCaddy(t, site)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})

	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("request through the tunnel: %d", code)
	}
	var lines []map[string]any
	testwait.Until(t, 10*time.Second, "the request's access line", func() bool {
		lines = jsonLines(t, accessLog, "handled request")
		return len(lines) > 0
	})
	l := lines[len(lines)-1]
	if l["sluice_agent"] != "agent-a" || l["sluice_route"] != "app.test" {
		t.Fatalf("access line names agent %v, route %v; want agent-a, app.test: %v", l["sluice_agent"], l["sluice_route"], l)
	}
	if tr, _ := l["sluice_transport"].(string); tr != "lane" {
		t.Fatalf("access line's transport %q: %v", tr, l)
	}
}

// TestAccessLineForEachTCPConnection: every layer4 connection through the
// tunnel ends with one INFO line on the sluice.access logger, which a
// global log can include by name, with its bytes each way and its
// outcome; a connection no agent serves has one too.
func TestAccessLineForEachTCPConnection(t *testing.T) {
	port, unserved := freePort(t), freePort(t)
	accessLog := filepath.Join(t.TempDir(), "sluice-access.log")
	global := fmt.Sprintf(`	log sluice_access {
		output sluice_test_file %s
		include sluice.access
	}
	layer4 {
		127.0.0.1:%d 127.0.0.1:%d {
			route {
				sluice
			}
		}
	}
`, accessLog, port, unserved)
	c := startCaddyWith(t, caddyOptions{Global: global}, "")
	echo := serveTCP(t, echoHandler)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(echo)})

	sizes := []int{1, 70000, 300000}
	for _, n := range sizes {
		msg := bytes.Repeat([]byte("s"), n)
		if got, err := dialEcho(loopback(port), msg); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("echo of %d bytes: %d back, %v", n, len(got), err)
		}
	}
	if conn, err := net.Dial("tcp", loopback(unserved)); err == nil {
		expectClosedWithin(t, conn, 5*time.Second)
	}

	var lines []map[string]any
	testwait.Until(t, 10*time.Second, "an access line per connection", func() bool {
		lines = jsonLines(t, accessLog, "tcp connection")
		return len(lines) >= len(sizes)+1
	})
	if len(lines) != len(sizes)+1 {
		t.Fatalf("%d access lines, want %d: %v", len(lines), len(sizes)+1, lines)
	}
	// Lines come as relays end, not in the order the connections opened.
	unservedAt := slices.IndexFunc(lines, func(l map[string]any) bool { return l["outcome"] == "no_route" })
	if unservedAt < 0 {
		t.Fatalf("no no_route line for the unserved port: %v", lines)
	}
	checkTCPAccessLine(t, lines[unservedAt], "", "no_route")
	relayed := slices.Delete(slices.Clone(lines), unservedAt, unservedAt+1)
	t.Logf("an access line: %v", relayed[0])
	for _, l := range relayed {
		checkTCPAccessLine(t, l, "agent-a", "ok")
	}
	for _, n := range sizes {
		if !slices.ContainsFunc(relayed, func(l map[string]any) bool {
			return l["bytes_from_client"] == float64(n) && l["bytes_to_client"] == float64(n)
		}) {
			t.Errorf("no access line with %d bytes each way: %v", n, relayed)
		}
	}
}

// checkTCPAccessLine checks the fields every TCP access line has.
func checkTCPAccessLine(t testing.TB, l map[string]any, agentID, outcome string) {
	t.Helper()
	if l["logger"] != "sluice.access" || l["level"] != "info" {
		t.Errorf("access line logged by %v at %v, want sluice.access at info: %v", l["logger"], l["level"], l)
	}
	if l["agent"] != agentID || l["outcome"] != outcome {
		t.Errorf("access line: agent %v, outcome %v; want %q, %q: %v", l["agent"], l["outcome"], agentID, outcome, l)
	}
	for _, k := range []string{"client", "route", "transport", "duration", "suppressed_since_last"} {
		if _, ok := l[k]; !ok {
			t.Errorf("access line without %s: %v", k, l)
		}
	}
}

// TestAccessWebSocketStreamLineCountsBytes: the "stream closed" line of a
// WebSocket counts the bytes it carried each way, which reverse_proxy
// copies past the handler's response writer.
func TestAccessWebSocketStreamLineCountsBytes(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "ws.test", Target: up})

	ws := dialWS(t, c, "ws.test")
	defer ws.CloseNow()
	const msgs, size = 64, 16 << 10 // 1 MiB each way
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msg := bytes.Repeat([]byte{0xa5}, size)
	for i := range msgs {
		if err := ws.Write(ctx, websocket.MessageBinary, msg); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if _, got, err := ws.Read(ctx); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("read %d: %d bytes, %v", i, len(got), err)
		}
	}
	ws.Close(websocket.StatusNormalClosure, "")

	l := c.waitHostStreamLine(t, "ws.test", 10*time.Second)
	const want = msgs * size
	if l.Classification != "upgrade" || l.BytesIn < want || l.BytesOut < want {
		t.Fatalf("stream line: %s, %d bytes in, %d out; want upgrade, ≥ %d each way", l.Classification, l.BytesIn, l.BytesOut, want)
	}
	// Framing adds a little, never as much again.
	if l.BytesIn > 2*want || l.BytesOut > 2*want {
		t.Fatalf("stream line counts %d bytes in, %d out for %d each way", l.BytesIn, l.BytesOut, want)
	}
}
