package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// dashboardPath is the Grafana dashboard, relative to this package.
const dashboardPath = "../dashboards/sluice.json"

// grafanaDashboard is the part of a dashboard's JSON the test reads.
type grafanaDashboard struct {
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Query      any    `json:"query"` // a string, or {"query": ...}
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

type grafanaPanel struct {
	Title   string         `json:"title"`
	Type    string         `json:"type"`
	Panels  []grafanaPanel `json:"panels"` // a collapsed row's
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
}

// dashTarget is one query of a panel.
type dashTarget struct{ panel, ref, expr string }

func (d dashTarget) String() string {
	return fmt.Sprintf("panel %q query %s: %s", d.panel, d.ref, d.expr)
}

func loadDashboard(t *testing.T) (grafanaDashboard, []dashTarget) {
	t.Helper()
	raw, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	var targets []dashTarget
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				targets = append(targets, dashTarget{p.Title, tg.RefID, tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	if len(targets) < 20 {
		t.Fatalf("%s has %d queries", dashboardPath, len(targets))
	}
	return d, targets
}

var (
	promSelector = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}`)
	promMatcher  = regexp.MustCompile(`(\w+)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"`)
	promRange    = regexp.MustCompile(`\[([^\]]*)\]`)
	bareMetric   = regexp.MustCompile(`\b(?:sluice|process|go)_\w+|\bup\b`)
)

// vectorSelector is one metric{matchers} of a query.
type vectorSelector struct {
	text, metric string
	matchers     map[string]string // label → operator and quoted value, e.g. `=~"$node"`
}

// selectors returns the vector selectors of expr, and any metric named
// without braces (which could select nothing of the variables).
func selectors(expr string) (sels []vectorSelector, bare []string) {
	for _, m := range promSelector.FindAllStringSubmatch(expr, -1) {
		s := vectorSelector{text: m[0], metric: m[1], matchers: map[string]string{}}
		for _, mm := range promMatcher.FindAllStringSubmatch(m[2], -1) {
			s.matchers[mm[1]] = mm[2] + `"` + mm[3] + `"`
		}
		sels = append(sels, s)
	}
	return sels, bareMetric.FindAllString(promSelector.ReplaceAllString(expr, ""), -1)
}

// TestDashboardQueriesUseVariables is the dashboard's variable rule, by
// the text of its queries alone:
//   - every metric is selected in braces with job=~"$job" and
//     instance=~"$instance";
//   - a sluice_ metric also with node=~"$node" (the node's series, all of
//     which carry node) or node="" (an agent's series, which carry none:
//     agent and node share some metric names); other metrics (up,
//     process_, go_) with no node matcher;
//   - route=~"$route" only on sluice_ metrics (TestDashboardQueriesAgainstPrometheus
//     checks it is there exactly where the selected series carry route);
//   - every range is [$__rate_interval].
//
// The variables themselves: datasource, job, instance, node and route.
func TestDashboardQueriesUseVariables(t *testing.T) {
	d, targets := loadDashboard(t)
	var vars []string
	for _, v := range d.Templating.List {
		vars = append(vars, v.Name+":"+v.Type)
	}
	for _, want := range []string{"datasource:datasource", "job:query", "instance:query", "node:query", "route:query"} {
		if !slices.Contains(vars, want) {
			t.Errorf("no variable %s (have %v)", want, vars)
		}
	}
	for _, tg := range targets {
		for _, problem := range variableRule(tg.expr) {
			t.Errorf("%s: %s", tg, problem)
		}
	}
}

func variableRule(expr string) (problems []string) {
	sels, bare := selectors(expr)
	for _, b := range bare {
		problems = append(problems, fmt.Sprintf("%s selected without the variables", b))
	}
	if len(sels) == 0 {
		problems = append(problems, "no metric selector")
	}
	for _, s := range sels {
		if s.matchers["job"] != `=~"$job"` || s.matchers["instance"] != `=~"$instance"` {
			problems = append(problems, fmt.Sprintf("%s: want job=~\"$job\" and instance=~\"$instance\"", s.text))
		}
		node, hasNode := s.matchers["node"]
		route, hasRoute := s.matchers["route"]
		switch sluice := strings.HasPrefix(s.metric, "sluice_"); {
		case sluice && node != `=~"$node"` && node != `=""`:
			problems = append(problems, fmt.Sprintf("%s: want node=~\"$node\" (node series) or node=\"\" (agent series)", s.text))
		case !sluice && (hasNode || hasRoute):
			problems = append(problems, fmt.Sprintf("%s: %s has no node or route label", s.text, s.metric))
		}
		if hasRoute && route != `=~"$route"` {
			problems = append(problems, fmt.Sprintf("%s: want route=~\"$route\"", s.text))
		}
		for label := range s.matchers {
			if !slices.Contains([]string{"job", "instance", "node", "route"}, label) {
				problems = append(problems, fmt.Sprintf("%s: matcher on %s, which no variable sets", s.text, label))
			}
		}
	}
	for _, r := range promRange.FindAllStringSubmatch(expr, -1) {
		if r[1] != "$__rate_interval" {
			problems = append(problems, fmt.Sprintf("range [%s], want [$__rate_interval]", r[1]))
		}
	}
	return problems
}

// dashboardSites serves Caddy's metrics handler on metrics.test (for the
// harness's scrapes) and on 127.0.0.1 (for Prometheus, which sends the
// target's address as Host), and tunnels app.test with /up as a stream.
const dashboardSites = "http://metrics.test:{HTTP}, http://127.0.0.1:{HTTP} {\n\tmetrics\n}\n\n" +
	"http://app.test:{HTTP} {\n\tsluice {\n\t\tstream_path_prefixes /up\n\t}\n}\n"

// TestDashboardQueriesAgainstPrometheus: a real Prometheus scrapes an
// in-process Caddy (the node) and agent after traffic through an HTTP and
// a TCP route; every query of the dashboard, its variables set as Grafana
// would (one node, both routes, both jobs and instances), returns data,
// each of its selectors selects series (else the metric is named), of
// the node's job for node=~"$node" and of the agent's for node="", with
// route=~"$route" exactly where those series carry route; and the
// variables' label_values queries list the node, the routes, the jobs
// and the instances.
func TestDashboardQueriesAgainstPrometheus(t *testing.T) {
	prom, err := exec.LookPath("prometheus")
	if err != nil {
		skipOrFail(t, "prometheus is needed to evaluate the dashboard's queries")
	}
	d, targets := loadDashboard(t)

	tcpPort := freePort(t)
	global := fmt.Sprintf("\tlayer4 {\n\t\t127.0.0.1:%d {\n\t\t\troute {\n\t\t\t\tsluice\n\t\t\t}\n\t\t}\n\t}\n", tcpPort)
	c := startCaddyWith(t, caddyOptions{Global: global, Sluice: "\t\tnode_id metrics-node"}, dashboardSites)
	adminAddr := loopback(freePort(t))
	echo := serveTCP(t, echoHandler)
	startAgentWith(t, c.serverURL(), "dash-agent", func(cfg *agent.Config) { cfg.AdminListen = adminAddr },
		agent.Upstream{ListenPort: tcpPort, Target: tcpTarget(echo)},
		agent.Upstream{Host: "app.test", Target: sizedUpstream(t, 100<<10)})

	// Traffic: an HTTP exchange past the initial window (credit) that is
	// a stream (/up), a TCP echo, and a TCP connection held open for the
	// open-connection panels.
	metricsHTTPTraffic(t, c, 100<<10, 100<<10)
	tcpRoute := ":" + strconv.Itoa(tcpPort)
	metricsTCPTraffic(t, c, tcpRoute, 70000)
	held, err := net.Dial("tcp", loopback(tcpPort))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { held.Close() })
	if err := echoWithin(held, "held", 5*time.Second); err != nil {
		t.Fatalf("held connection: %v", err)
	}

	caddyTarget := fmt.Sprintf("127.0.0.1:%d", c.httpPort)
	api := startPrometheus(t, prom, map[string]string{"caddy": caddyTarget, "agent": adminAddr})

	quote := func(vals ...string) string { // a multi-value variable as Grafana formats it for Prometheus
		for i, v := range vals {
			vals[i] = strings.ReplaceAll(regexp.QuoteMeta(v), `\`, `\\`)
		}
		return "(" + strings.Join(vals, "|") + ")"
	}
	subst := strings.NewReplacer(
		"$__rate_interval", "15s",
		"$job", quote("caddy", "agent"),
		"$instance", quote(caddyTarget, adminAddr),
		"$node", quote("metrics-node"),
		"$route", quote("app.test", tcpRoute),
	)

	// Queries wait (bounded) for enough scrapes; then every one still
	// empty is reported.
	pending := slices.Clone(targets)
	deadline := time.Now().Add(45 * time.Second)
	testwait.Until(t, 60*time.Second, "the dashboard's queries answered", func() bool {
		pending = slices.DeleteFunc(pending, func(tg dashTarget) bool {
			return len(api.query(t, subst.Replace(tg.expr))) > 0
		})
		return len(pending) == 0 || time.Now().After(deadline)
	})
	for _, tg := range pending {
		var missing []string
		sels, _ := selectors(tg.expr)
		for _, s := range sels {
			if len(api.series(t, subst.Replace(s.text))) == 0 {
				missing = append(missing, s.metric)
			}
		}
		t.Errorf("%s: no data; metrics without series: %v", tg, missing)
	}

	for _, tg := range targets {
		sels, _ := selectors(tg.expr)
		for _, s := range sels {
			series := api.series(t, subst.Replace(s.text))
			if len(series) == 0 {
				why := s.metric + " is in neither scrape"
				if len(api.series(t, s.metric)) > 0 {
					why = s.metric + " has series, but none that match"
				}
				t.Errorf("%s: %s selects no series: %s", tg, s.text, why)
				continue
			}
			withRoute := slices.ContainsFunc(series, func(l map[string]string) bool { return l["route"] != "" })
			if _, hasRoute := s.matchers["route"]; withRoute != hasRoute {
				t.Errorf("%s: %s: its series carry route: %v; route=~\"$route\" in the selector: %v", tg, s.text, withRoute, hasRoute)
			}
			wantJob := map[string]string{`=~"$node"`: "caddy", `=""`: "agent"}[s.matchers["node"]]
			for _, l := range series {
				if wantJob != "" && l["job"] != wantJob {
					t.Errorf("%s: %s selects a series of job %s, want only %s: %v", tg, s.text, l["job"], wantJob, l)
					break
				}
			}
		}
	}

	want := map[string][]string{
		"job": {"caddy", "agent"}, "instance": {caddyTarget, adminAddr},
		"node": {"metrics-node"}, "route": {"app.test", tcpRoute},
	}
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("variable %s: %q is not label_values(selector, label)", v.Name, v.Definition)
			continue
		}
		got := api.labelValues(t, m[2], subst.Replace(m[1]))
		for _, w := range want[v.Name] {
			if !slices.Contains(got, w) {
				t.Errorf("variable %s: %s lists %v, want %s among them", v.Name, v.Definition, got, w)
			}
		}
	}
	if !t.Failed() {
		t.Logf("%d queries of %s answered by Prometheus", len(targets), dashboardPath)
	}
}

// promAPI is a Prometheus HTTP API on loopback.
type promAPI struct{ base string }

// startPrometheus runs prometheus on loopback scraping each job's one
// target every second, with its storage in a temporary directory, and
// waits until every target is up. Cleanup stops it (bounded).
func startPrometheus(t *testing.T, prom string, jobs map[string]string) promAPI {
	t.Helper()
	dir := t.TempDir()
	cfg := "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
	for job, target := range jobs {
		cfg += fmt.Sprintf("  - job_name: %s\n    static_configs:\n      - targets: ['%s']\n", job, target)
	}
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	listen := loopback(freePort(t))
	cmd := exec.Command(prom, "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+listen, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("prometheus: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Error("prometheus did not stop within 10s of SIGTERM")
		}
		logFile.Close()
		if t.Failed() {
			if out, err := os.ReadFile(logFile.Name()); err == nil && len(out) > 0 {
				t.Logf("prometheus log:\n%s", out)
			}
		}
	})
	api := promAPI{base: "http://" + listen}
	testwait.Until(t, 30*time.Second, "prometheus scraping every target", func() bool {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("prometheus exited: %v", err)
		default:
		}
		var res struct {
			ActiveTargets []struct {
				Health    string `json:"health"`
				ScrapeURL string `json:"scrapeUrl"`
			} `json:"activeTargets"`
		}
		if !api.get("/api/v1/targets", nil, &res) {
			return false
		}
		up := 0
		for _, tg := range res.ActiveTargets {
			if tg.Health == "up" {
				up++
			}
		}
		return up == len(jobs) && len(res.ActiveTargets) == len(jobs)
	})
	return api
}

var promClient = &http.Client{Timeout: 5 * time.Second}

// get GETs an API path into the response's data; false if Prometheus
// does not answer (yet) or answers an error.
func (p promAPI) get(path string, params url.Values, data any) bool {
	resp, err := promClient.Get(p.base + path + "?" + params.Encode())
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	var res struct {
		Status string          `json:"status"`
		Data   json.RawMessage `json:"data"`
	}
	if err != nil || resp.StatusCode != http.StatusOK || json.Unmarshal(body, &res) != nil || res.Status != "success" {
		return false
	}
	return json.Unmarshal(res.Data, data) == nil
}

// mustGet is get for a Prometheus that answered before: an error fails
// the test with Prometheus' answer.
func (p promAPI) mustGet(t *testing.T, path string, params url.Values, data any) {
	t.Helper()
	if p.get(path, params, data) {
		return
	}
	resp, err := promClient.Get(p.base + path + "?" + params.Encode())
	if err != nil {
		t.Fatalf("%s %v: %v", path, params, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	t.Fatalf("%s %v: %d %s", path, params, resp.StatusCode, body)
}

// query evaluates expr now and returns its series' labels.
func (p promAPI) query(t *testing.T, expr string) []map[string]string {
	t.Helper()
	var res struct {
		Result []struct {
			Metric map[string]string `json:"metric"`
		} `json:"result"`
	}
	p.mustGet(t, "/api/v1/query", url.Values{"query": {expr}}, &res)
	out := make([]map[string]string, len(res.Result))
	for i, r := range res.Result {
		out[i] = r.Metric
	}
	return out
}

// series lists the label sets a selector matched over the last minute.
func (p promAPI) series(t *testing.T, selector string) []map[string]string {
	t.Helper()
	var res []map[string]string
	start := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	p.mustGet(t, "/api/v1/series", url.Values{"match[]": {selector}, "start": {start}}, &res)
	return res
}

// labelValues lists the values of label on the series of selector.
func (p promAPI) labelValues(t *testing.T, label, selector string) []string {
	t.Helper()
	var res []string
	p.mustGet(t, "/api/v1/label/"+label+"/values", url.Values{"match[]": {selector}}, &res)
	return res
}
