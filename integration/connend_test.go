package integration

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// TestEveryConnectionIsAccounted: a TCP relay and an HTTP request each
// report their end to the node (tunnelcore's OnConnEnd): the node's
// totals count the connections and the bytes each way, the relay's
// included.
func TestEveryConnectionIsAccounted(t *testing.T) {
	port := freePort(t)
	global := fmt.Sprintf(`	layer4 {
		127.0.0.1:%d {
			route {
				sluice
			}
		}
	}
`, port)
	c := startCaddyWith(t, caddyOptions{Global: global}, "http://app.test:{HTTP} {\n\tsluice\n}\n")
	echo := serveTCP(t, echoHandler)
	up := startUpstream(t, "accounted")
	a := startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{ListenPort: port, Target: tcpTarget(echo)},
		agent.Upstream{Host: "app.test", Target: up})
	before := c.mustStats(t)

	conn, err := net.Dial("tcp", loopback(port))
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("sluice "), 10000) // 70,000 bytes
	go conn.Write(payload)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(conn, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through the tunnel: %v", err)
	}
	conn.Close()
	testwait.Until(t, 10*time.Second, "the relay's end accounted", func() bool {
		st := c.mustStats(t)
		return st.ConnectionsEnded-before.ConnectionsEnded >= 1 &&
			st.BytesFromClients-before.BytesFromClients >= int64(len(payload)) &&
			st.BytesToClients-before.BytesToClients >= int64(len(payload))
	})
	if from := c.mustStats(t).BytesFromClients - before.BytesFromClients; from != int64(len(payload)) {
		t.Fatalf("%d bytes from the client accounted, want %d", from, len(payload))
	}

	// An HTTP request: its pooled connection ends when the agent's
	// session does, and is accounted then.
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("request through the tunnel: %d", code)
	}
	mid := c.mustStats(t)
	a.stop()
	testwait.Until(t, 10*time.Second, "the HTTP connection's end accounted", func() bool {
		st := c.mustStats(t)
		return st.ConnectionsEnded > mid.ConnectionsEnded && st.BytesToClients > mid.BytesToClients
	})
}
