package caddymodule

import (
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// FuzzValidateRoutes: admission of any Advertise never panics, answers for
// every route exactly once (accepted or rejected), keeps accepted patterns
// within their bounds and the node within its pattern budget, and a
// pattern's DFA answers as its regexp does.
func FuzzValidateRoutes(f *testing.F) {
	f.Add("app.test", `[a-z0-9-]+\.apps\.example\.com`, "10.0.0.0/8", uint32(0), "web", false, "http://127.0.0.1:80", "x.apps.example.com")
	f.Add("", `(?:.{0,40}){5}zz`, "::ffff:10.0.0.0/104", uint32(16379), "", true, "tcp://db:5432", "zz")
	f.Add("Upper.test", `x)|(.*`, "bad", uint32(70000), "*", false, "tcp://x:1", "")
	f.Fuzz(func(t *testing.T, host, pattern, cidr string, port uint32, name string, passthrough bool, target, probe string) {
		routes := []*tunnelpb.Route{
			{Host: host, HostPattern: pattern, AllowedCidrs: []string{cidr}, ListenPort: port, Name: name, TlsPassthrough: passthrough, Target: target},
			{HostPattern: pattern, Name: name}, // a duplicate name, when name is set
			{HostPattern: pattern},             // named by its pattern
			{Host: host, ListenPort: port},     // a port route
			{Name: name + "2", HostPattern: pattern + pattern},
		}
		ok, rejected := validateRoutes(routes)
		answered(t, routes, ok, rejected)
		insts := 0
		for _, e := range ok {
			if e.pattern == nil {
				continue
			}
			m, n, err := compileHostMatcher(e.route.GetHostPattern())
			if err != nil || m.cost != e.pattern.cost || e.pattern.cost+patternEntryCost > patternBudget {
				t.Fatalf("accepted pattern %q: %v, cost %d", e.route.GetHostPattern(), err, e.pattern.cost)
			}
			insts += n
			if e.pattern.dfa != nil {
				if got, done := e.pattern.dfa.match(probe); done && got != e.pattern.re.MatchString(probe) {
					t.Fatalf("pattern %q on %q: the DFA says %v, the regexp not", e.route.GetHostPattern(), probe, got)
				}
			}
		}
		if insts > maxAdvertiseInsts {
			t.Fatalf("accepted patterns of %d instructions together", insts)
		}

		r := newRegistry()
		for _, id := range []string{"a", "b", "c"} {
			entries, _ := validateRoutes(routes)
			a := &agentSession{agentID: id}
			kept, over := r.bind(a, entries, nil)
			if len(kept)+len(over) != len(entries) {
				t.Fatalf("bind: %d kept, %d rejected of %d", len(kept), len(over), len(entries))
			}
			r.register(a, kept)
			if load := r.table.Load().load.total; load > patternBudget {
				t.Fatalf("node load %d over the budget %d", load, patternBudget)
			}
		}
		tab := r.table.Load()
		tab.lookupHTTP(probe)
		tab.lookupSNI(probe)
		tab.lookupName(probe)
	})
}

// answered checks that every route is accepted or rejected, once.
func answered(t *testing.T, routes []*tunnelpb.Route, ok []*routeEntry, rejected []*tunnelpb.RejectedRoute) {
	t.Helper()
	if len(ok)+len(rejected) != len(routes) {
		t.Fatalf("%d routes: %d accepted, %d rejected", len(routes), len(ok), len(rejected))
	}
	seen := map[*tunnelpb.Route]bool{}
	for _, e := range ok {
		if seen[e.route] {
			t.Fatalf("route %v accepted twice", e.route)
		}
		seen[e.route] = true
	}
}
