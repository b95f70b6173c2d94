package integration

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/caddyserver/caddy/v2/modules/metrics" // the metrics handler
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// metricsSites serves Caddy's metrics handler on metrics.test and tunnels
// app.test.
const metricsSites = "http://metrics.test:{HTTP} {\n\tmetrics\n}\n\nhttp://app.test:{HTTP} {\n\tsluice {\n\t\tstream_path_prefixes /up\n\t}\n}\n"

// scrapeMetrics reads the metrics handler's exposition.
func scrapeMetrics(t testing.TB, c *caddyServer) string {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url("/metrics"), nil)
	req.Host = "metrics.test"
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v: %s", resp.StatusCode, err, body)
	}
	return string(body)
}

var labelPair = regexp.MustCompile(`(\w+)="((?:[^"\\]|\\.)*)"`)

// metricSum sums the samples of name whose labels include labels.
func metricSum(text, name string, labels map[string]string) (sum float64, found bool) {
	for line := range strings.Lines(text) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		cut := strings.LastIndexByte(line, ' ')
		got := map[string]string{}
		for _, m := range labelPair.FindAllStringSubmatch(line[:cut], -1) {
			got[m[1]] = m[2]
		}
		match := true
		for k, v := range labels {
			match = match && got[k] == v
		}
		if v, err := strconv.ParseFloat(line[cut+1:], 64); match && err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}

// nodeMetric is metricSum of the test node's series.
func nodeMetric(text, name string, kv ...string) float64 {
	labels := map[string]string{"node": "metrics-node"}
	for i := 0; i+1 < len(kv); i += 2 {
		labels[kv[i]] = kv[i+1]
	}
	v, _ := metricSum(text, name, labels)
	return v
}

// sizedUpstream answers each request with size bytes after reading the
// body, and closes its connection, so the tunnel's connection ends (and
// is counted) with the exchange.
func sizedUpstream(t testing.TB, size int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Connection", "close")
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Write(bytes.Repeat([]byte("x"), size))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// TestMetricsNodeReportsTrafficAndRefusals: after traffic through an HTTP
// and a TCP route, Caddy's metrics handler shows the bytes per route
// (within the HTTP framing of what the client sent and got), the
// connections, the refusals by reason after each is forced, and the
// sessions going from 1 to 0 as the agent leaves; every sluice metric
// carries node_id and passes promlint.
func TestMetricsNodeReportsTrafficAndRefusals(t *testing.T) {
	port := freePort(t)
	global := fmt.Sprintf("\tlayer4 {\n\t\t127.0.0.1:%d {\n\t\t\troute {\n\t\t\t\tsluice\n\t\t\t}\n\t\t}\n\t}\n", port)
	c := startCaddyWith(t, caddyOptions{Global: global, Sluice: "\t\tnode_id metrics-node\n\t\tmax_connections 2\n" +
		"\t\tmax_pending_streams 1\n\t\tadvertise_timeout 1s"}, metricsSites)
	const upload, download = 200 << 10, 300 << 10
	echo := serveTCP(t, echoHandler)
	a := startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{ListenPort: port, Target: tcpTarget(echo)},
		agent.Upstream{Host: "app.test", Target: sizedUpstream(t, download)})
	if v := nodeMetric(scrapeMetrics(t, c), "sluice_tunnel_sessions"); v != 1 {
		t.Fatalf("sluice_tunnel_sessions = %v with one agent, want 1", v)
	}

	metricsHTTPTraffic(t, c, upload, download)
	tcpRoute := ":" + strconv.Itoa(port)
	metricsTCPTraffic(t, c, tcpRoute, 70000)
	metricsMaxConnections(t, c, tcpRoute)
	metricsStreamRefusals(t, c)

	// A reload registers the collector into the new config's registry;
	// the counters live in the node, which the reload keeps.
	before := nodeMetric(scrapeMetrics(t, c), "sluice_tunnel_bytes_total", "route", "app.test")
	c.load(metricsSites)
	if code, _ := getAfterReload(t, c, "metrics.test", "/metrics"); code != http.StatusOK {
		t.Fatalf("metrics after a reload: %d", code)
	}
	after := scrapeMetrics(t, c)
	if v := nodeMetric(after, "sluice_tunnel_bytes_total", "route", "app.test"); v < before || before == 0 {
		t.Errorf("app.test bytes %v after a reload, %v before", v, before)
	}
	if v := nodeMetric(after, "sluice_tunnel_sessions"); v != 1 {
		t.Errorf("sluice_tunnel_sessions = %v after a reload, want 1", v)
	}

	a.stop()
	testwait.Until(t, 10*time.Second, "sluice_tunnel_sessions back to 0", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_tunnel_sessions") == 0
	})
	metricsLint(t, scrapeMetrics(t, c))
}

// metricsHTTPTraffic posts upload bytes to app.test and reads download
// bytes back, then checks the route's bytes and connection count.
func metricsHTTPTraffic(t *testing.T, c *caddyServer, upload, download int) {
	t.Helper()
	req, _ := http.NewRequest("POST", c.url("/up"), bytes.NewReader(bytes.Repeat([]byte("u"), upload)))
	req.Host = "app.test"
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	n, _ := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || n != int64(download) {
		t.Fatalf("POST through the tunnel: %d, %d bytes", resp.StatusCode, n)
	}
	const framing = 4 << 10 // request and response heads, chunk framing
	var text string
	testwait.Until(t, 10*time.Second, "the HTTP connection counted", func() bool {
		text = scrapeMetrics(t, c)
		return nodeMetric(text, "sluice_connections_total", "route", "app.test", "kind", "http") >= 1
	})
	toAgent := nodeMetric(text, "sluice_tunnel_bytes_total", "route", "app.test", "direction", "to_agent")
	toClient := nodeMetric(text, "sluice_tunnel_bytes_total", "route", "app.test", "direction", "to_client")
	t.Logf("app.test: %v bytes to the agent for %d sent, %v to the client for %d received", toAgent, upload, toClient, download)
	if toAgent < float64(upload) || toAgent > float64(upload+framing) {
		t.Errorf("app.test to_agent = %v bytes, want %d plus at most %d of framing", toAgent, upload, framing)
	}
	if toClient < float64(download) || toClient > float64(download+framing) {
		t.Errorf("app.test to_client = %v bytes, want %d plus at most %d of framing", toClient, download, framing)
	}
	// Both bodies pass the 64 KiB initial window: credit was granted
	// each way. /up is a stream by its path (stream_path_prefixes).
	for _, dir := range []string{"sent", "received"} {
		if v := nodeMetric(text, "sluice_tunnel_window_updates_total", "direction", dir); v < 1 {
			t.Errorf("sluice_tunnel_window_updates_total{direction=%q} = %v after bodies past the window", dir, v)
		}
	}
	if _, ok := metricSum(text, "sluice_tunnel_credit_waits_total", nil); !ok {
		t.Error("no sluice_tunnel_credit_waits_total")
	}
	if _, ok := metricSum(text, "sluice_tunnel_stall_seconds", nil); !ok {
		t.Error("no sluice_tunnel_stall_seconds")
	}
	testwait.Until(t, 10*time.Second, "the stream counted", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_streams_total", "class", "path_prefix", "outcome", "completed") == 1
	})
}

// metricsTCPTraffic echoes size bytes through the TCP route and checks
// its bytes (exact: no framing) and its connection, closed cleanly.
func metricsTCPTraffic(t *testing.T, c *caddyServer, route string, size int) {
	t.Helper()
	payload := bytes.Repeat([]byte("s"), size)
	got, err := dialEcho(loopback(mustPort(t, route)), payload)
	if err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through the tunnel: %v", err)
	}
	testwait.Until(t, 10*time.Second, "the TCP connection counted", func() bool {
		text := scrapeMetrics(t, c)
		return nodeMetric(text, "sluice_connections_total", "route", route, "kind", "tcp") >= 1 &&
			nodeMetric(text, "sluice_tunnel_bytes_total", "route", route, "direction", "to_client") >= float64(size)
	})
	text := scrapeMetrics(t, c)
	for _, dir := range []string{"to_agent", "to_client"} {
		if v := nodeMetric(text, "sluice_tunnel_bytes_total", "route", route, "direction", dir); v != float64(size) {
			t.Errorf("%s %s = %v bytes, want %d", route, dir, v, size)
		}
	}
	if v := nodeMetric(text, "sluice_connections_total", "route", route, "kind", "tcp", "outcome", "closed"); v != 1 {
		t.Errorf("%s connections closed cleanly = %v, want 1", route, v)
	}
}

func mustPort(t testing.TB, route string) int {
	p, err := strconv.Atoi(strings.TrimPrefix(route, ":"))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// metricsMaxConnections holds max_connections (2) TCP connections open:
// they show as active on their route, and a third is refused and counted.
func metricsMaxConnections(t *testing.T, c *caddyServer, route string) {
	t.Helper()
	testwait.Until(t, 10*time.Second, "every connection slot free", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_data_connections_admitted") == 0
	})
	for range 2 {
		conn, err := net.Dial("tcp", loopback(mustPort(t, route)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		if err := echoWithin(conn, "held", 5*time.Second); err != nil {
			t.Fatalf("held connection: %v", err)
		}
	}
	text := scrapeMetrics(t, c)
	if v := nodeMetric(text, "sluice_connections_active", "route", route); v != 2 {
		t.Errorf("%s active = %v, want 2", route, v)
	}
	if v := nodeMetric(text, "sluice_data_connections_limit"); v != 2 {
		t.Errorf("sluice_data_connections_limit = %v, want 2", v)
	}
	third, err := net.Dial("tcp", loopback(mustPort(t, route)))
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if _, err := limClosedWithin(third, 5*time.Second); err != nil {
		t.Fatalf("third connection past max_connections: %v", err)
	}
	testwait.Until(t, 5*time.Second, "the max_connections refusal counted", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_data_connections_rejected_total", "reason", "max_connections") == 1
	})
}

// metricsStreamRefusals forces a wrong token, a stream past
// max_pending_streams (1) and an advertise timeout, and finds each counted.
func metricsStreamRefusals(t *testing.T, c *caddyServer) {
	t.Helper()
	bad := launchAgent(t, c.serverURL(), "agent-bad", "wrong-token-0123456789abcdef0123456789", agent.Upstream{Host: "bad.test", Target: "http://127.0.0.1:1"})
	testwait.Until(t, 10*time.Second, "the wrong token counted", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_auth_failures_total") >= 1
	})
	bad.stop()

	cc := limControlClient(t, c)
	silent := limOpenRaw(t, cc) // holds the one pending place, then times out
	testwait.Until(t, 5*time.Second, "the silent stream pending", func() bool {
		return nodeMetric(scrapeMetrics(t, c), "sluice_tunnel_streams_pending") == 1
	})
	second := limOpenRaw(t, cc)
	if end, ok := second.end(5 * time.Second); !ok || !strings.Contains(limStatus(end.err), "ResourceExhausted") {
		t.Fatalf("second pending stream: %+v (ended %v), want RESOURCE_EXHAUSTED", end, ok)
	}
	if _, ok := silent.end(5 * time.Second); !ok {
		t.Fatal("the silent stream outlived advertise_timeout")
	}
	text := scrapeMetrics(t, c)
	for reason, want := range map[string]float64{"max_pending_streams": 1, "advertise_timeout": 1} {
		if v := nodeMetric(text, "sluice_tunnel_streams_refused_total", "reason", reason); v != want {
			t.Errorf("streams refused for %s = %v, want %v", reason, v, want)
		}
	}
	if v := nodeMetric(text, "sluice_tunnel_advertise_timeouts_total"); v != 1 {
		t.Errorf("sluice_tunnel_advertise_timeouts_total = %v, want 1", v)
	}
}

// metricsLint runs promlint over the sluice metrics of a scrape, and
// checks each carries the node label.
func metricsLint(t *testing.T, text string) {
	t.Helper()
	problems, err := promlint.New(strings.NewReader(text)).Lint()
	if err != nil {
		t.Fatalf("promlint: %v", err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "sluice_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
	series := 0
	for line := range strings.Lines(text) {
		if strings.HasPrefix(line, "sluice_") {
			series++
			if !strings.Contains(line, `node="metrics-node"`) {
				t.Errorf("series without the node label: %s", strings.TrimSpace(line))
			}
		}
	}
	if series < 20 {
		t.Errorf("%d sluice series scraped; want every metric", series)
	}
}
