package caddymodule

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/caddyauth" // basic_auth in the adapt test
)

// consoleCall serves one request through c as Caddy's server would: an
// error becomes its status. orig, when set, is the path the client asked
// for before a prefix was stripped (handle_path).
func consoleCall(t *testing.T, c *Console, method, target, orig string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(method, target, nil)
	if orig != "" {
		o := httptest.NewRequest(method, orig, nil)
		req = req.WithContext(context.WithValue(req.Context(), caddyhttp.OriginalRequestCtxKey, *o))
	}
	rec := httptest.NewRecorder()
	if err := c.ServeHTTP(rec, req, nil); err != nil {
		var he caddyhttp.HandlerError
		if !errors.As(err, &he) {
			t.Fatalf("%s %s: %v is not a HandlerError", method, target, err)
		}
		rec.Code = he.StatusCode
	}
	return rec
}

func TestConsoleStateShowsAgentsAndRouteTables(t *testing.T) {
	n, _ := adminNode(t)
	rec := consoleCall(t, &Console{node: n}, "GET", "/console/api/state", "")
	if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("%d %q %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
	}
	body := rec.Body.String()
	for _, secret := range []string{"secret-token", "user:pass", "http://", "tcp://"} {
		if strings.Contains(body, secret) {
			t.Fatalf("state shows %q:\n%s", secret, body)
		}
	}
	var st ConsoleState
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Agents) != 2 || st.Agents[0].AgentID != "a1" || st.Agents[1].Build != "v-test" {
		t.Fatalf("agents: %+v", st.Agents)
	}
	if st.Node.ServingSince.IsZero() || st.Node.Build == "" || st.Node.Caddy == "" {
		t.Fatalf("node: %+v", st.Node)
	}
	r := st.Routes
	want := ConsoleRoute{Key: "app.test", Kind: "host", Agent: "a1", Route: "app.test", Others: []string{"a2"}}
	if len(r.Hosts) != 1 || !routeRowEqual(r.Hosts[0], want) {
		t.Fatalf("hosts: %+v", r.Hosts)
	}
	if len(r.Patterns) != 1 || r.Patterns[0].Key != `[a-z]+\.wild\.test` || len(r.CatchAll) != 1 || r.CatchAll[0].Agent != "a1" {
		t.Fatalf("patterns %+v, catch-all %+v", r.Patterns, r.CatchAll)
	}
	if len(r.TCPNames) != 1 || r.TCPNames[0].Key != "redis" || r.TCPNames[0].Agent != "a2" {
		t.Fatalf("tcp names: %+v", r.TCPNames)
	}
	if len(r.PortRoute) != 1 || r.PortRoute[0].Key != "15432" || r.SNI == nil || r.Ports == nil {
		t.Fatalf("port routes %+v, sni %v, ports %v", r.PortRoute, r.SNI, r.Ports)
	}
	if _, ok := st.Refusals.Limits["max_connections"]; !ok || len(st.Refusals.Streams) != len(streamRefusalNames) {
		t.Fatalf("refusals: %+v", st.Refusals)
	}
}

func routeRowEqual(a, b ConsoleRoute) bool {
	return a.Key == b.Key && a.Kind == b.Kind && a.Agent == b.Agent && a.Route == b.Route && slices.Equal(a.Others, b.Others)
}

func TestConsoleLookup(t *testing.T) {
	n, _ := adminNode(t)
	c := &Console{node: n}
	for _, tc := range []struct{ query, match, agent string }{
		{"host=APP.test:443", "exact", "a1"},
		{"host=x.wild.test", "pattern", "a1"},
		{"host=nothing.test", "catch_all", "a1"},
		{"name=redis", "name", "a2"},
		{"port=15432", "port_route", "a1"},
		{"port=15433", "none", ""},
	} {
		rec := consoleCall(t, c, "GET", "/c/api/lookup?"+tc.query, "")
		var got ConsoleLookup
		if err := json.Unmarshal(rec.Body.Bytes(), &got); rec.Code != 200 || err != nil {
			t.Fatalf("%s: %d %s %v", tc.query, rec.Code, rec.Body, err)
		}
		if got.Lookup.Match != tc.match || got.Lookup.Agent != tc.agent {
			t.Errorf("%s: %+v, want %s %s", tc.query, got.Lookup, tc.match, tc.agent)
		}
	}
	for _, bad := range []string{"", "host=a&port=1", "port=x", "port=0"} {
		if rec := consoleCall(t, c, "GET", "/c/api/lookup?"+bad, ""); rec.Code != 400 || !strings.Contains(rec.Body.String(), "error") {
			t.Errorf("%q: %d %s", bad, rec.Code, rec.Body)
		}
	}
}

// TestConsolePrefix: the handler serves by the last segments of the path,
// so any mount works, stripped or not; the mount without its slash is
// redirected relative to itself.
func TestConsolePrefix(t *testing.T) {
	n, _ := adminNode(t)
	c := &Console{node: n}
	for _, tc := range []struct {
		path, orig string
		code       int
		ctype      string
	}{
		{"/", "", 200, "text/html; charset=utf-8"},
		{"/", "/console/", 200, "text/html; charset=utf-8"},
		{"/console/", "", 200, "text/html; charset=utf-8"},
		{"/a/b/c/index.html", "", 200, "text/html; charset=utf-8"},
		{"/app.js", "/ops/sluice/app.js", 200, "text/javascript; charset=utf-8"},
		{"/ops/sluice/style.css", "", 200, "text/css; charset=utf-8"},
		{"/ops/sluice/api/state", "", 200, "application/json"},
		{"/ops/sluice/secret.txt", "", 404, ""},
		{"/ops/sluice/api/other", "", 404, ""},
		{"/console", "", 404, ""}, // not the mount: a route /console/* never sends it
	} {
		rec := consoleCall(t, c, "GET", tc.path, tc.orig)
		if rec.Code != tc.code || rec.Header().Get("Content-Type") != tc.ctype {
			t.Errorf("%s (%s): %d %q, want %d %q", tc.path, tc.orig, rec.Code, rec.Header().Get("Content-Type"), tc.code, tc.ctype)
		}
		if tc.code == 200 && !strings.Contains(rec.Header().Get("Content-Security-Policy"), "script-src 'self'") {
			t.Errorf("%s: no CSP", tc.path)
		}
	}
	for _, tc := range []struct{ path, orig, loc string }{
		{"/", "/console", "console/"},
		{"/?x=1", "/ops/console?x=1", "console/?x=1"},
		{"/", "/", ""},
	} {
		rec := consoleCall(t, c, "GET", tc.path, tc.orig)
		if tc.loc == "" {
			if rec.Code != 200 {
				t.Errorf("%s (%s): %d", tc.path, tc.orig, rec.Code)
			}
			continue
		}
		if rec.Code != http.StatusMovedPermanently || rec.Header().Get("Location") != tc.loc {
			t.Errorf("%s (%s): %d %q, want 301 %q", tc.path, tc.orig, rec.Code, rec.Header().Get("Location"), tc.loc)
		}
	}
	if rec := consoleCall(t, c, "POST", "/console/api/state", ""); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d", rec.Code)
	}
}

// TestConsolePageHasNoInlineCode: the CSP allows no inline script or
// style, and the page renders data as text only.
func TestConsolePageHasNoInlineCode(t *testing.T) {
	n, _ := adminNode(t)
	c := &Console{node: n}
	page := consoleCall(t, c, "GET", "/", "").Body.String()
	if strings.Contains(page, "<script>") || strings.Contains(page, "style=") || strings.Contains(page, "http") {
		t.Fatalf("index.html has inline code or an absolute URL:\n%s", page)
	}
	js := consoleCall(t, c, "GET", "/app.js", "").Body.String()
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "\"/api"} {
		if strings.Contains(js, bad) {
			t.Errorf("app.js uses %s", bad)
		}
	}
}

func TestConsoleCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{":80 {\n\tsluice_console /console/* extra\n}\n", `sluice_console: takes no arguments, got "extra"`},
		{":80 {\n\tsluice_console {\n\t\tprefix /console\n\t}\n}\n", `sluice_console: takes no block`},
	} {
		_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(tc.in), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got %v, want %q", tc.in, err, tc.want)
		}
	}
}
