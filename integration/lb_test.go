package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// Load balancing of layer4 routes (lb_policy of the layer4 sluice
// handler), full stack: real Caddy with a layer4 server per policy, two
// real agents serving the same named routes, each to an upstream of its
// own that names itself in its first line, and real TCP clients.

// lbGlobal is a layer4 block with one server per policy in ports, each
// relaying to the route of the policy's own name (so that the connections
// of one policy leave the others' counts alone), and one TLS passthrough
// server for lb.pass.test under round_robin.
func lbGlobal(ports map[string]int, passPort int) string {
	s := "\tlayer4 {\n"
	for _, policy := range []string{"first", "round_robin", "random", "least_conn"} {
		s += fmt.Sprintf("\t\t127.0.0.1:%d {\n\t\t\troute {\n\t\t\t\tsluice %s {\n\t\t\t\t\tlb_policy %s\n\t\t\t\t}\n\t\t\t}\n\t\t}\n",
			ports[policy], policy, policy)
	}
	s += fmt.Sprintf(`		127.0.0.1:%d {
			@pass tls sni lb.pass.test
			route @pass {
				sluice {
					lb_policy round_robin
				}
			}
		}
`, passPort)
	return s + "\t}\n"
}

// TestLayer4LBPolicies: round_robin spreads 100 connections over two
// agents evenly (also by TLS server name, passthrough), first sends every
// one to the smallest agent id, random uses both agents, and least_conn
// sends the connections that come while one is held on agent-a to
// agent-b.
func TestLayer4LBPolicies(t *testing.T) {
	ports := map[string]int{}
	for _, p := range []string{"first", "round_robin", "random", "least_conn"} {
		ports[p] = freePort(t)
	}
	passPort := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: lbGlobal(ports, passPort), CaptureLog: true}, "")

	for _, id := range []string{"agent-b", "agent-a"} { // connecting order does not matter
		up := serveTCP(t, greetEchoHandler(id))
		web := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, id)
		}))
		t.Cleanup(web.Close)
		var upstreams []agent.Upstream
		for _, name := range []string{"first", "round_robin", "random", "least_conn"} {
			upstreams = append(upstreams, agent.Upstream{Name: name, Target: tcpTarget(up)})
		}
		upstreams = append(upstreams, agent.Upstream{Host: "lb.pass.test", TLSPassthrough: true,
			Target: tcpTarget(web.Listener.Addr().(*net.TCPAddr).Port)})
		startAgent(t, c.serverURL(), id, upstreams...)
	}
	// Both agents' routes are in the table once both connected (startAgent
	// waits for the AdvertiseAck).

	// least_conn first: its check reads the access lines, of which the
	// node writes at most 100 a second.
	t.Run("least_conn", func(t *testing.T) {
		addr := loopback(ports["least_conn"])
		held, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Close()
		if got := readGreeting(t, held); got != "agent-a" {
			t.Fatalf("first connection (none open) went to %s, want agent-a (the first on a tie)", got)
		}
		for i := range 10 {
			if got, err := greeting(addr); err != nil || got != "agent-b" {
				t.Fatalf("connection %d while one is held on agent-a: %q %v, want agent-b", i, got, err)
			}
			// The next connection must find this one's relay ended, or
			// the counts tie: its access line is written after that.
			testwait.Until(t, 10*time.Second, fmt.Sprintf("the access line of connection %d", i), func() bool {
				return lbAccessLines(t, c, "least_conn", "agent-b") == i+1
			})
		}
		// The held connection is still agent-a's, and still works.
		if _, err := held.Write([]byte("still here\n")); err != nil {
			t.Fatal(err)
		}
		if got := readGreeting(t, held); got != "still here" {
			t.Fatalf("held connection echoed %q", got)
		}
	})

	t.Run("round_robin", func(t *testing.T) {
		counts := lbSpread(t, loopback(ports["round_robin"]), 100)
		for _, id := range []string{"agent-a", "agent-b"} {
			if n := counts[id]; n < 45 || n > 55 {
				t.Errorf("round_robin: %v, want 50 ± 5 each", counts)
			}
		}
	})

	t.Run("first", func(t *testing.T) {
		if counts := lbSpread(t, loopback(ports["first"]), 20); counts["agent-a"] != 20 {
			t.Errorf("first: %v, want all 20 on agent-a", counts)
		}
	})

	t.Run("random", func(t *testing.T) {
		// Both are used but with probability 2·2⁻¹⁰⁰.
		counts := lbSpread(t, loopback(ports["random"]), 100)
		if counts["agent-a"] == 0 || counts["agent-b"] == 0 || counts["agent-a"]+counts["agent-b"] != 100 {
			t.Errorf("random: %v, want both agents used", counts)
		}
	})

	t.Run("round_robin by server name", func(t *testing.T) {
		counts := map[string]int{}
		for i := range 10 {
			code, body, err := httpsGetVia(loopback(passPort), "lb.pass.test")
			if err != nil || code != 200 {
				t.Fatalf("passthrough request %d: %d %q %v", i, code, body, err)
			}
			counts[body]++
		}
		if counts["agent-a"] != 5 || counts["agent-b"] != 5 {
			t.Errorf("round_robin by TLS server name: %v, want 5 each", counts)
		}
	})
}

// readGreeting reads the next line on c (at first, the upstream's name)
// byte by byte, so that c stays open with nothing read past it.
func readGreeting(t *testing.T, c net.Conn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	var line []byte
	b := make([]byte, 1)
	for len(line) < 64 {
		if _, err := c.Read(b); err != nil {
			t.Fatalf("reading a line: %v (after %q)", err, line)
		}
		if b[0] == '\n' {
			return string(line)
		}
		line = append(line, b[0])
	}
	t.Fatalf("no greeting line in %q", line)
	return ""
}

// lbSpread makes n connections to addr, four at a time, and counts the
// agents that answered them.
func lbSpread(t *testing.T, addr string, n int) map[string]int {
	t.Helper()
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		wg     sync.WaitGroup
		next   = make(chan int)
	)
	for range 4 {
		wg.Go(func() {
			for i := range next {
				got, err := greeting(addr)
				mu.Lock()
				if err != nil {
					t.Errorf("connection %d: %v", i, err)
				}
				counts[got]++
				mu.Unlock()
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return counts
}

// lbAccessLines counts the node's access lines of connections on route
// that agent served.
func lbAccessLines(t *testing.T, c *caddyServer, route, agentID string) int {
	t.Helper()
	n := 0
	for _, line := range c.logLines(t, "tcp connection") {
		var l struct {
			Route, Agent string
		}
		if json.Unmarshal(line, &l) == nil && l.Route == route && l.Agent == agentID {
			n++
		}
	}
	return n
}
