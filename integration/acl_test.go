package integration

import (
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
)

// TestAllowedCIDRs: a route's allowed_cidrs decide which client addresses
// may use it, for HTTP (403) and for TCP (closed at once).
func TestAllowedCIDRs(t *testing.T) {
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: fmt.Sprintf("\tsluice {\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1\n\t}\n", port, port)}, siteAll)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "open.test", Target: up, AllowedCIDRs: []string{"127.0.0.0/8"}},
		agent.Upstream{Host: "closed.test", Target: up, AllowedCIDRs: []string{"10.0.0.0/8", "192.0.2.0/24"}},
		agent.Upstream{Name: "tcp", ListenPort: port, Target: "tcp://" + strings.TrimPrefix(up, "http://"), AllowedCIDRs: []string{"10.0.0.0/8"}})

	if code, body := get(t, c, "open.test", "/"); code != 200 || !strings.Contains(body, "Hello from app") {
		t.Fatalf("allowed client: %d %q", code, body)
	}
	if code, body := get(t, c, "closed.test", "/"); code != 403 || !strings.Contains(body, "may not use the tunnel for closed.test") {
		t.Fatalf("excluded client: %d %q", code, body)
	}

	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: open.test\r\n\r\n")
	if n, err := io.ReadFull(conn, make([]byte, 1)); err == nil || n != 0 {
		t.Fatalf("excluded TCP client got %d bytes, err %v; want the connection closed", n, err)
	}
}
