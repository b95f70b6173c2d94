package caddymodule

import (
	"encoding/json"
	"errors"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// adminCall serves one request through the admin route of a for path, as
// Caddy's admin server would (an error becomes its status), and returns
// the status and body.
func adminCall(t *testing.T, a *AdminAPI, method, target string) (int, string) {
	t.Helper()
	req := httptest.NewRequest(method, target, nil)
	for _, rt := range a.Routes() {
		if rt.Pattern != req.URL.Path {
			continue
		}
		rec := httptest.NewRecorder()
		if err := rt.Handler.ServeHTTP(rec, req); err != nil {
			var apiErr caddy.APIError
			if !errors.As(err, &apiErr) {
				t.Fatalf("%s %s: %v is not an APIError", method, target, err)
			}
			return apiErr.HTTPStatus, apiErr.Err.Error()
		}
		return rec.Code, rec.Body.String()
	}
	t.Fatalf("no admin route for %s", target)
	return 0, ""
}

// adminNode is a serving node with two agents' sessions: a1 serves
// app.test, a wildcard pattern, the catch-all and a listen-port route; a2
// app.test and a named TCP service.
func adminNode(t *testing.T) (*node, *AdminAPI) {
	t.Helper()
	n := testNode(t)
	tok := "secret-token-never-shown"
	storeToken(t, n, tok)
	for _, ag := range []struct {
		id     string
		routes []*tunnelpb.Route
	}{
		{"a1", []*tunnelpb.Route{
			{Host: "app.test", Target: "http://127.0.0.1:1"},
			{HostPattern: `[a-z]+\.wild\.test`, Target: "http://127.0.0.1:2"},
			{Target: "http://user:pass@127.0.0.1:3"},
			{ListenPort: 15432, Target: "tcp://127.0.0.1:4"},
		}},
		{"a2", []*tunnelpb.Route{
			{Host: "app.test", Target: "http://127.0.0.1:5", AllowedCidrs: []string{"10.0.0.0/8"}},
			{Name: "redis", Target: "tcp://127.0.0.1:6"},
		}},
	} {
		a := register(t, n.reg, ag.id, ag.routes...)
		a.sess, _ = testSessionPair(t)
		a.auth, a.remote, a.build = authn{cred: n.creds.Load().byName[""]}, "192.0.2.1:4000", "v-test"
	}
	return n, &AdminAPI{nodes: func() []*node { return []*node{n} }}
}

func TestAdminStatusReportsSessionsAndLimits(t *testing.T) {
	n, api := adminNode(t)
	code, body := adminCall(t, api, "GET", "/sluice/status")
	if code != 200 {
		t.Fatalf("status: %d %s", code, body)
	}
	for _, secret := range []string{"secret-token", "user:pass", "http://", "tcp://"} {
		if strings.Contains(body, secret) {
			t.Fatalf("status shows %q:\n%s", secret, body)
		}
	}
	var resp StatusResponse
	if err := json.Unmarshal([]byte(body), &resp); err != nil {
		t.Fatal(err)
	}
	if len(resp.Nodes) != 1 {
		t.Fatalf("nodes: %+v", resp.Nodes)
	}
	st := resp.Nodes[0]
	if st.ID != n.listener.Addr().String() || st.Listen != "test" || !st.Ready || st.Draining {
		t.Fatalf("node: %+v", st)
	}
	if len(st.Sessions) != 2 || st.Sessions[0].AgentID != "a1" || st.Sessions[1].AgentID != "a2" {
		t.Fatalf("sessions: %+v", st.Sessions)
	}
	s := st.Sessions[0]
	if s.Build != "v-test" || s.Remote != "192.0.2.1:4000" || len(s.Routes) != 4 || s.Transport == "" {
		t.Fatalf("session a1: %+v", s)
	}
	kinds := []string{}
	for _, r := range s.Routes {
		kinds = append(kinds, r.Kind)
	}
	if got := strings.Join(kinds, ","); got != "host,host pattern,catch-all,listen port" {
		t.Fatalf("a1 route kinds: %s", got)
	}
	if st.Limits.TunnelBudget.Limit == 0 || st.Limits.TCPPortRange != "unset" {
		t.Fatalf("limits: %+v", st.Limits)
	}
	for _, key := range []string{`"connected_since"`, `"max_sessions"`, `"in_use"`, `"agent_id"`, `"ports"`} {
		if !strings.Contains(body, key) {
			t.Fatalf("status lacks %s:\n%s", key, body)
		}
	}
}

func TestAdminLookup(t *testing.T) {
	_, api := adminNode(t)
	for _, tc := range []struct{ query, match, agent, route, others string }{
		{"host=APP.test:8080", "exact", "a1", "app.test", "a2"},
		{"host=x.wild.test", "pattern", "a1", `[a-z]+\.wild\.test`, ""},
		{"host=other.test", "catch_all", "a1", "*", ""},
		{"name=redis", "name", "a2", "redis", ""},
		{"name=app.test", "name", "a1", "app.test", "a2"},
		{"port=15432", "port_route", "a1", ":15432", ""},
		{"port=15433", "none", "", "", ""},
		{"server_name=app.test", "none", "", "", ""},
	} {
		code, body := adminCall(t, api, "GET", "/sluice/lookup?"+tc.query)
		if code != 200 {
			t.Fatalf("%s: %d %s", tc.query, code, body)
		}
		var resp LookupResponse
		if err := json.Unmarshal([]byte(body), &resp); err != nil {
			t.Fatal(err)
		}
		l := resp.Nodes[0]
		var others []string
		for _, o := range l.Others {
			others = append(others, o.Agent)
		}
		route := ""
		if l.Route != nil {
			route = l.Route.Name
		}
		if l.Match != tc.match || l.Agent != tc.agent || route != tc.route || strings.Join(others, ",") != tc.others {
			t.Errorf("%s: got %s", tc.query, body)
		}
	}
}

func TestAdminLookupRefusesBadQueries(t *testing.T) {
	_, api := adminNode(t)
	for _, tc := range []struct {
		method, target string
		code           int
	}{
		{"GET", "/sluice/lookup", 400},
		{"GET", "/sluice/lookup?host=a.test&name=b", 400},
		{"GET", "/sluice/lookup?port=70000", 400},
		{"GET", "/sluice/lookup?host=a%20b", 400},
		{"GET", "/sluice/lookup?host=a.test&listen=127.0.0.1:1", 404},
		{"POST", "/sluice/status", 405},
	} {
		if code, body := adminCall(t, api, tc.method, tc.target); code != tc.code {
			t.Errorf("%s %s: %d %s, want %d", tc.method, tc.target, code, body, tc.code)
		}
	}
}

// TestAdminReadyDownWhileDraining: readiness is 503 naming the reason once
// the node drains; liveness stays 200.
func TestAdminReadyDownWhileDraining(t *testing.T) {
	n, api := adminNode(t)
	if code, body := adminCall(t, api, "GET", "/sluice/ready?listen=test"); code != 200 || !strings.Contains(body, `"status":"ready"`) {
		t.Fatalf("ready before the drain: %d %s", code, body)
	}
	n.drain()
	code, body := adminCall(t, api, "GET", "/sluice/ready")
	if code != 503 || !strings.Contains(body, `"reason":"draining"`) {
		t.Fatalf("ready while draining: %d %s", code, body)
	}
	if code, body := adminCall(t, api, "GET", "/sluice/health"); code != 200 || !strings.Contains(body, `"status":"live"`) {
		t.Fatalf("health while draining: %d %s", code, body)
	}
	empty := &AdminAPI{nodes: func() []*node { return nil }}
	if code, body := adminCall(t, empty, "GET", "/sluice/ready"); code != 503 || !strings.Contains(body, "no sluice node") {
		t.Fatalf("ready without a node: %d %s", code, body)
	}
}

// TestAdminModuleRegistered: Caddy's admin server finds the routes.
func TestAdminModuleRegistered(t *testing.T) {
	mi, err := caddy.GetModule("admin.api.sluice")
	if err != nil {
		t.Fatal(err)
	}
	router, ok := mi.New().(caddy.AdminRouter)
	if !ok {
		t.Fatalf("admin.api.sluice: %T", mi.New())
	}
	var patterns []string
	for _, rt := range router.Routes() {
		patterns = append(patterns, rt.Pattern)
	}
	want := []string{"/sluice/status", "/sluice/lookup", "/sluice/health", "/sluice/ready", "/sluice/certificates"}
	if !slices.Equal(patterns, want) {
		t.Fatalf("admin.api.sluice routes %v, want %v", patterns, want)
	}
}
