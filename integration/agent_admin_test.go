package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest/observer"

	"github.com/sluice-tunnel/sluice/agent"
)

// adminClient reads an agent's admin listener: /healthz, /readyz,
// /status and /metrics.
type adminClient struct {
	t    testing.TB
	base string
	hc   *http.Client
}

func newAdminClient(t testing.TB, addr string) *adminClient {
	return &adminClient{t: t, base: "http://" + addr, hc: &http.Client{Timeout: 5 * time.Second}}
}

// get returns the status code and body of path; code 0 when the listener
// did not answer.
func (a *adminClient) get(path string) (int, string) {
	a.t.Helper()
	resp, err := a.hc.Get(a.base + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		a.t.Fatalf("GET %s: %v", path, err)
	}
	return resp.StatusCode, string(b)
}

// status decodes /status.
func (a *adminClient) status() agent.Status {
	a.t.Helper()
	code, body := a.get("/status")
	if code != 200 {
		a.t.Fatalf("/status: %d %s", code, body)
	}
	var st agent.Status
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		a.t.Fatalf("/status: %v\n%s", err, body)
	}
	return st
}

// metric returns the value of one series of /metrics, written as the
// exposition writes it (`name{label="value",...}`, labels sorted).
func (a *adminClient) metric(series string) float64 {
	a.t.Helper()
	code, body := a.get("/metrics")
	if code != 200 {
		a.t.Fatalf("/metrics: %d %s", code, body)
	}
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				a.t.Fatalf("/metrics: %q: %v", line, err)
			}
			return f
		}
	}
	a.t.Fatalf("/metrics has no %s:\n%s", series, body)
	return 0
}

// readyWithin waits until /readyz answers want, and returns its body.
func (a *adminClient) readyWithin(within time.Duration, want int) string {
	a.t.Helper()
	var body string
	eventually(a.t, within, fmt.Sprintf("/readyz %d", want), func() bool {
		var code int
		code, body = a.get("/readyz")
		return code == want
	})
	return body
}

// TestAgentAdmin runs an agent with its admin listener against a real
// node: not ready before the node is up, ready within a second of it
// coming up, not ready within a second of it stopping; /status and
// /metrics report the session, the routes and the bytes they relayed.
func TestAgentAdmin(t *testing.T) {
	controlPort, adminAddr := freePort(t), fmt.Sprintf("127.0.0.1:%d", freePort(t))
	up := startUpstream(t, "app")
	ag, logs := launchAgentLogged(t, fmt.Sprintf("grpc://127.0.0.1:%d", controlPort), "agent-admin", testToken,
		func(c *agent.Config) { c.AdminListen = adminAddr }, true,
		agent.Upstream{Host: "app.test", Target: up})
	adm := newAdminClient(t, adminAddr)
	eventually(t, 5*time.Second, "the admin listener", func() bool { code, _ := adm.get("/healthz"); return code == 200 })
	if body := adm.readyWithin(time.Second, 503); !strings.Contains(body, "no session with grpc://127.0.0.1:") {
		t.Errorf("/readyz before the node: %q", body)
	}

	eventually(t, 5*time.Second, "a retry while no node listens", func() bool { return adm.metric("sluice_reconnect_total") >= 1 })

	c := startCaddyWith(t, caddyOptions{Listen: fmt.Sprintf("127.0.0.1:%d", controlPort)}, siteAll)
	adm.readyWithin(time.Second, 200)
	if code, body := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("through the tunnel: %d %s", code, body)
	}
	checkAdminConnected(t, adm, logs)
	reconnectsBefore := adm.metric("sluice_reconnect_total")

	caddyStop(t)
	if body := adm.readyWithin(time.Second, 503); !strings.HasPrefix(body, "not ready: ") {
		t.Errorf("/readyz after the node stopped: %q", body)
	}
	eventually(t, 5*time.Second, "the session's end and a reconnect attempt", func() bool {
		return adm.metric("sluice_tunnel_sessions") == 0 && adm.metric("sluice_reconnect_total") > reconnectsBefore
	})
	// The connections ended with the session: their bytes are counted.
	from := adm.metric(`sluice_tunnel_bytes_total{direction="from_client",route="app.test"}`)
	to := adm.metric(`sluice_tunnel_bytes_total{direction="to_client",route="app.test"}`)
	if from < float64(len("GET / HTTP/1.1\r\n")) || to < float64(len("HTTP/1.1 200 OK\r\n")) {
		t.Errorf("bytes of app.test: %v from the client, %v to it", from, to)
	}
	st := adm.status()
	if r := st.Routes[0]; r.Ack != agent.AckPending || r.BytesFromClient != int64(from) || r.BytesToClient != int64(to) {
		t.Errorf("route after the node stopped: %+v", r)
	}
	if s := st.Sessions[0]; s.State == "connected" || s.NodeBuild != "" || s.Established != 1 {
		t.Errorf("session after the node stopped: %+v", s)
	}
	if code, _ := adm.get("/healthz"); code != 200 {
		t.Errorf("/healthz after the node stopped: %d", code)
	}
	ag.stop()
	if code, _ := adm.get("/healthz"); code != 0 {
		t.Errorf("/healthz answered %d after Run returned", code)
	}
}

// checkAdminConnected checks /status, /metrics and the "connected" line
// of TestAgentAdmin's agent while it is connected.
func checkAdminConnected(t *testing.T, adm *adminClient, logs *observer.ObservedLogs) {
	t.Helper()
	st := adm.status()
	if !st.Ready || st.AgentID != "agent-admin" || len(st.Sessions) != 1 || len(st.Routes) != 1 || len(st.PortClaims) != 0 {
		t.Fatalf("status %+v", st)
	}
	s := st.Sessions[0]
	if s.State != "connected" || s.NodeID == "" || !strings.HasPrefix(s.NodeBuild, "sluice-node ") ||
		s.Transport != agent.TransportDataLane || s.Established != 1 || s.Reconnects < 1 {
		t.Errorf("session %+v", s)
	}
	if r := st.Routes[0]; r.Name != "app.test" || r.Kind != "host" || r.Ack != agent.AckAccepted {
		t.Errorf("route %+v", r)
	}
	if st.Limits.MaxConnections <= 0 || st.Limits.TunnelBudget <= 0 {
		t.Errorf("limits %+v", st.Limits)
	}
	if v := adm.metric("sluice_tunnel_sessions"); v != 1 {
		t.Errorf("sluice_tunnel_sessions %v", v)
	}
	if v := adm.metric("sluice_connections_limit"); v != float64(st.Limits.MaxConnections) {
		t.Errorf("sluice_connections_limit %v, status %d", v, st.Limits.MaxConnections)
	}
	if v := adm.metric("sluice_reconnect_total"); v != float64(s.Reconnects) {
		t.Errorf("sluice_reconnect_total %v, status %d", v, s.Reconnects)
	}
	found := false
	for _, e := range logs.FilterMessage("connected").All() {
		if b, _ := e.ContextMap()["node_build"].(string); b == s.NodeBuild {
			found = true
		}
	}
	if !found {
		t.Errorf(`no "connected" line with node_build %q`, s.NodeBuild)
	}
}
