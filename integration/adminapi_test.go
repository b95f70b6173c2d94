package integration

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/caddymodule"
)

// sluiceAdmin serves admin.api.sluice as Caddy's admin server would: the
// module registered in this binary, reading the running nodes. (The
// harness turns the admin endpoint off.) It returns the status and body of
// a GET of target.
func sluiceAdmin(t *testing.T) func(target string) (int, string) {
	t.Helper()
	mi, err := caddy.GetModule("admin.api.sluice")
	if err != nil {
		t.Fatal(err)
	}
	routes := mi.New().(caddy.AdminRouter).Routes()
	return func(target string) (int, string) {
		t.Helper()
		req := httptest.NewRequest("GET", target, nil)
		for _, rt := range routes {
			if rt.Pattern != req.URL.Path {
				continue
			}
			rec := httptest.NewRecorder()
			if err := rt.Handler.ServeHTTP(rec, req); err != nil {
				var apiErr caddy.APIError
				if !errors.As(err, &apiErr) {
					t.Fatalf("GET %s: %v", target, err)
				}
				return apiErr.HTTPStatus, apiErr.Err.Error()
			}
			return rec.Code, rec.Body.String()
		}
		t.Fatalf("admin.api.sluice has no route for %s", target)
		return 0, ""
	}
}

// adminLookup asks the admin API which agent serves query on the node of
// c, and returns that node's answer.
func adminLookup(t *testing.T, admin func(string) (int, string), c *caddyServer, query string) caddymodule.Lookup {
	t.Helper()
	code, body := admin("/sluice/lookup?" + query + "&listen=" + url.QueryEscape(controlAddr(c)))
	var resp caddymodule.LookupResponse
	if err := json.Unmarshal([]byte(body), &resp); code != 200 || err != nil || len(resp.Nodes) != 1 {
		t.Fatalf("lookup %s: %d %s (%v)", query, code, body, err)
	}
	return resp.Nodes[0]
}

func controlAddr(c *caddyServer) string { return fmt.Sprintf("127.0.0.1:%d", c.controlPort) }

// TestAdminAPIStatusAndLookup: /sluice/status shows the connected agents,
// and /sluice/lookup names, for a host (exact, pattern, catch-all), a
// route name (layer4 `sluice NAME`) and a claimed port, the agent that
// then serves the request or connection.
func TestAdminAPIStatusAndLookup(t *testing.T) {
	port, l4 := freePort(t), freePort(t)
	global := portRangeGlobal(port, port) + fmt.Sprintf("\tlayer4 {\n\t\t127.0.0.1:%d {\n\t\t\troute {\n\t\t\t\tsluice svc\n\t\t\t}\n\t\t}\n\t}\n", l4)
	c := startCaddyWith(t, caddyOptions{Global: global}, siteAll)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "app.test", Target: startUpstream(t, "A")},
		agent.Upstream{HostPattern: `[a-z]+\.wild\.test`, Target: startUpstream(t, "wild")},
		agent.Upstream{Name: "svc", Target: tcpTarget(serveTCP(t, greetEchoHandler("svc-a")))},
		agent.Upstream{ListenPort: port, Target: tcpTarget(serveTCP(t, greetEchoHandler("port-a")))})
	startAgent(t, c.serverURL(), "agent-b",
		agent.Upstream{Host: "*", Target: startUpstream(t, "catchall")},
		agent.Upstream{Name: "svc", Target: tcpTarget(serveTCP(t, greetEchoHandler("svc-b")))})
	admin := sluiceAdmin(t)
	checkStatus(t, admin, c, port)

	// What each (agent, route) answers: its upstream's greeting.
	answers := map[string]string{
		"agent-a app.test": "Hello from A", "agent-a [a-z]+\\.wild\\.test": "Hello from wild",
		"agent-b *": "Hello from catchall", "agent-a svc": "svc-a", "agent-b svc": "svc-b",
		fmt.Sprintf("agent-a :%d", port): "port-a",
	}
	for _, tc := range []struct{ query, match, host, dial string }{
		{"host=app.test", "exact", "app.test", ""},
		{"host=x.wild.test", "pattern", "x.wild.test", ""},
		{"host=other.test", "catch_all", "other.test", ""},
		{"name=svc", "name", "", loopback(l4)},
		{fmt.Sprintf("port=%d", port), "claimed_port", "", loopback(port)},
	} {
		l := adminLookup(t, admin, c, tc.query)
		if l.Match != tc.match || l.Route == nil {
			t.Fatalf("%s: match %q, route %v; want %q", tc.query, l.Match, l.Route, tc.match)
		}
		want := answers[l.Agent+" "+l.Route.Name]
		got := served(t, c, tc.host, tc.dial)
		if want == "" || !strings.Contains(got, want) {
			t.Errorf("%s: lookup names %s %s (answering %q), the request got %q", tc.query, l.Agent, l.Route.Name, want, got)
		}
	}
	if l := adminLookup(t, admin, c, "name=svc"); len(l.Others) != 1 || l.Others[0].Agent != "agent-b" {
		t.Fatalf("name=svc: others %+v, want agent-b", l.Others)
	}
}

// served is what the upstream answers a request for host, or a connection
// to dial.
func served(t *testing.T, c *caddyServer, host, dial string) string {
	t.Helper()
	if dial != "" {
		line, err := greeting(dial)
		if err != nil {
			t.Fatalf("dial %s: %v", dial, err)
		}
		return line
	}
	_, body := get(t, c, host, "/")
	return body
}

// checkStatus checks /sluice/status for the node of c with agent-a and
// agent-b connected and agent-a holding port.
func checkStatus(t *testing.T, admin func(string) (int, string), c *caddyServer, port int) {
	t.Helper()
	code, body := admin("/sluice/status?listen=" + url.QueryEscape(controlAddr(c)))
	var resp caddymodule.StatusResponse
	if err := json.Unmarshal([]byte(body), &resp); code != 200 || err != nil || len(resp.Nodes) != 1 {
		t.Fatalf("status: %d %s (%v)", code, body, err)
	}
	if strings.Contains(body, testToken) {
		t.Fatal("the status shows the token")
	}
	st := resp.Nodes[0]
	if st.ID == "" || st.Listen != controlAddr(c) || !st.Ready || st.Draining || st.Limits.MaxSessions.Limit != 1024 || st.Limits.MaxSessions.InUse != 2 {
		t.Fatalf("node: %s", body)
	}
	if len(st.Sessions) != 2 || st.Sessions[0].AgentID != "agent-a" || st.Sessions[1].AgentID != "agent-b" {
		t.Fatalf("sessions: %s", body)
	}
	a := st.Sessions[0]
	if !strings.HasPrefix(a.Remote, "127.0.0.1:") || time.Since(a.ConnectedSince) > time.Minute || a.Transport == "" || len(a.Routes) != 4 {
		t.Fatalf("agent-a: %+v", a)
	}
	if len(st.Ports) != 1 || st.Ports[0].Port != uint32(port) || st.Ports[0].Owner != "agent-a" {
		t.Fatalf("ports: %+v", st.Ports)
	}
}

// TestLookupLeavesRoundRobinAlone: 1,000 lookups (and one more: an odd
// number, so that lookups moving the policy's counter would flip the
// alternation) of a host two agents serve under lb_policy round_robin
// leave the policy's order as it was: the requests after them go where
// the alternation says.
func TestLookupLeavesRoundRobinAlone(t *testing.T) {
	c := startCaddy(t, "http://:{HTTP} {\n\tsluice {\n\t\tlb_policy round_robin\n\t}\n}\n")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "rr.test", Target: startUpstream(t, "A")})
	startAgent(t, c.serverURL(), "agent-b", agent.Upstream{Host: "rr.test", Target: startUpstream(t, "B")})
	next := func() string {
		_, body := get(t, c, "rr.test", "/")
		for _, name := range []string{"A", "B"} {
			if strings.Contains(body, "Hello from "+name) {
				return name
			}
		}
		t.Fatalf("rr.test answered %q", body)
		return ""
	}
	first, second := next(), next()
	if first == second {
		t.Fatalf("round_robin served %s twice", first)
	}
	admin := sluiceAdmin(t)
	for range 1001 {
		adminLookup(t, admin, c, "host=rr.test")
	}
	for i, want := range []string{first, second, first} {
		if got := next(); got != want {
			t.Fatalf("request %d after the lookups went to %s, want %s (round robin %s, %s, ...)", i+3, got, want, first, second)
		}
	}
	if l := adminLookup(t, admin, c, "host=rr.test"); l.Agent != "agent-a" || len(l.Others) != 1 || l.Others[0].Agent != "agent-b" {
		t.Fatalf("lookup: %+v", l)
	}
}

// TestSluiceHealthHandlerOnASite: the sluice_health handler answers a
// probe on a site, 200 while the node serves; its readiness goes down
// while the server shuts down (shutdown_delay) and liveness stays up; the
// admin API's ready agrees before.
func TestSluiceHealthHandlerOnASite(t *testing.T) {
	site := "http://:{HTTP} {\n\thandle /healthz/ready {\n\t\tsluice_health\n\t}\n\thandle /healthz/live {\n\t\tsluice_health live\n\t}\n\thandle {\n\t\tsluice\n\t}\n}\n"
	c := startCaddyWith(t, caddyOptions{Global: "\tshutdown_delay 3s\n"}, site)
	for _, path := range []string{"/healthz/ready", "/healthz/live"} {
		if code, body := get(t, c, "lb.test", path); code != 200 || !strings.Contains(body, `"status"`) {
			t.Fatalf("%s: %d %s", path, code, body)
		}
	}
	admin := sluiceAdmin(t)
	if code, body := admin("/sluice/ready?listen=" + url.QueryEscape(controlAddr(c))); code != 200 {
		t.Fatalf("admin ready: %d %s", code, body)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- caddy.Stop() }()
	eventually(t, 2*time.Second, "readiness down during shutdown_delay", func() bool {
		code, body := get(t, c, "lb.test", "/healthz/ready")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "shutting down")
	})
	if code, _ := get(t, c, "lb.test", "/healthz/live"); code != 200 {
		t.Fatalf("live during shutdown_delay: %d", code)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}

// TestAdminAPIReadyDownWhileExiting runs the real binary with its admin
// endpoint on loopback: /sluice/status over Caddy's admin server shows the
// agent, and once the process begins to exit (SIGINT) the node drains and
// readiness is 503, on the admin API and on the site's sluice_health,
// while shutdown_delay keeps the listeners open for the load balancer to
// see it.
func TestAdminAPIReadyDownWhileExiting(t *testing.T) {
	caddyBin := caddyBinary(t)
	adminPort, httpPort, controlPort := freePort(t), freePort(t), freePort(t)
	caddyfile := writeCaddyfile(t, fmt.Sprintf(`	admin 127.0.0.1:%d
	auto_https off
	shutdown_delay 5s
	sluice {
		listen 127.0.0.1:%d
		token %s
		drain_grace 1s
	}`, adminPort, controlPort, testToken), fmt.Sprintf(`http://:%d {
	bind 127.0.0.1
	handle /healthz/ready {
		sluice_health
	}
	handle {
		sluice
	}
}`, httpPort))
	cmd, _ := launchProcess(t, caddyBin, "run", "--config", caddyfile, "--adapter", "caddyfile")
	adminURL := fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	probeURL := fmt.Sprintf("http://127.0.0.1:%d/healthz/ready", httpPort)
	eventually(t, 20*time.Second, "the admin API ready", func() bool { return httpCode(adminURL+"/sluice/ready") == 200 })
	startAgent(t, fmt.Sprintf("grpc://127.0.0.1:%d", controlPort), "agent-exit", agent.Upstream{Host: "exit.test", Target: startUpstream(t, "exit")})
	if body := httpBody(t, adminURL+"/sluice/status"); !strings.Contains(body, `"agent_id":"agent-exit"`) {
		t.Fatalf("status over the admin endpoint: %s", body)
	}
	if code := httpCode(probeURL); code != 200 {
		t.Fatalf("sluice_health before the exit: %d", code)
	}

	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	eventually(t, 3*time.Second, "the admin API not ready, draining", func() bool {
		return strings.Contains(httpBody(t, adminURL+"/sluice/ready"), `"reason":"draining"`)
	})
	if code := httpCode(adminURL + "/sluice/ready"); code != 503 {
		t.Fatalf("admin ready while draining: %d", code)
	}
	if code := httpCode(probeURL); code != 503 {
		t.Fatalf("sluice_health while exiting: %d", code)
	}
}

// httpCode is the status of a GET of u; 0 when it fails.
func httpCode(u string) int {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(u)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// httpBody is the body of a GET of u.
func httpBody(t *testing.T, u string) string {
	t.Helper()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
