package caddymodule

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"github.com/sluice-tunnel/sluice/internal/hostname"
	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func register(t testing.TB, r *registry, id string, routes ...*tunnelpb.Route) *agentSession {
	t.Helper()
	a := &agentSession{agentID: id}
	entries, rejected := validateRoutes(routes)
	if len(rejected) > 0 {
		t.Fatalf("rejected: %v", rejected)
	}
	entries, rejected = r.bind(a, entries, nil)
	if len(rejected) > 0 {
		t.Fatalf("rejected by the pattern budget: %v", rejected)
	}
	r.register(a, entries)
	return a
}

// advertise admits routes for a session as node.admit and register or
// reroute do, and returns what was rejected.
func advertise(t *testing.T, r *registry, a *agentSession, routes ...*tunnelpb.Route) []*tunnelpb.RejectedRoute {
	t.Helper()
	entries, rejected := validateRoutes(routes)
	if len(rejected) > 0 {
		t.Fatalf("rejected by validation: %v", rejected)
	}
	entries, rejected = r.bind(a, entries, a.routes)
	if r.agents[a.key()] == a {
		r.reroute(a, entries)
	} else {
		r.register(a, entries)
	}
	return rejected
}

func agentsOf(es []*routeEntry) string {
	var ids []string
	for _, e := range es {
		ids = append(ids, e.agent.agentID+":"+routeName(e.route))
	}
	return strings.Join(ids, ",")
}

func TestRouteLookupOrder(t *testing.T) {
	r := newRegistry()
	register(t, r, "b", &tunnelpb.Route{Host: "app.test"}, &tunnelpb.Route{HostPattern: `[a-z]+\.wild\.test`})
	register(t, r, "a", &tunnelpb.Route{Host: "app.test"}, &tunnelpb.Route{}) // catch-all
	register(t, r, "c", &tunnelpb.Route{Host: "db.test", TlsPassthrough: true, Target: "tcp://x:1"},
		&tunnelpb.Route{ListenPort: 16379, Target: "tcp://x:2"})
	tab := r.table.Load()
	for host, want := range map[string]string{
		"app.test":       "a:app.test,b:app.test", // exact first, by agent id
		"x.wild.test":    `b:[a-z]+\.wild\.test`,  // then patterns, whole match
		"x.wild.test.io": "a:*",                   // then the catch-all
		"db.test":        "a:*",                   // passthrough never serves HTTP
	} {
		if got := agentsOf(tab.lookupHTTP(host)); got != want {
			t.Errorf("lookupHTTP(%s) = %s, want %s", host, got, want)
		}
	}
	if got := agentsOf(tab.lookupSNI("DB.test.")); got != "c:db.test" {
		t.Errorf("lookupSNI = %s", got)
	}
	if got := agentsOf(tab.byPort.get(16379)); got != "c::16379" {
		t.Errorf("byPort = %s", got)
	}
	if len(tab.lookupSNI("app.test")) != 0 {
		t.Error("an HTTP route must not take SNI-routed TCP")
	}
}

// A leaving session routes nothing new, keeps its dial addresses for the
// requests that chose it already, and lets a newer session of its id in
// without being displaced; its end unregisters it without touching that one.
func TestWithdrawnSessionRoutesNothingNew(t *testing.T) {
	r := newRegistry()
	a := register(t, r, "a", &tunnelpb.Route{Host: "app.test"}, &tunnelpb.Route{Name: "redis", Target: "tcp://x:1"},
		&tunnelpb.Route{Host: "db.test", TlsPassthrough: true, Target: "tcp://x:2"}, &tunnelpb.Route{ListenPort: 16379, Target: "tcp://x:3"})
	register(t, r, "b", &tunnelpb.Route{Host: "app.test"})
	dial := a.routes[0].dial
	if !r.withdraw(a) || !a.leaving.Load() {
		t.Fatal("withdraw of a registered session failed")
	}
	tab := r.table.Load()
	if got := agentsOf(tab.lookupHTTP("app.test")); got != "b:app.test" {
		t.Errorf("lookupHTTP = %s, want the other agent alone", got)
	}
	if len(tab.lookupName("redis")) != 0 || len(tab.lookupSNI("db.test")) != 0 || len(tab.byPort.get(16379)) != 0 {
		t.Error("a withdrawn session's TCP routes are still routed")
	}
	if e := tab.byDialAddress(dial + ":80"); e == nil || e.agent != a {
		t.Error("a withdrawn session's dial address no longer resolves")
	}
	if len(r.sessions()) != 2 {
		t.Errorf("sessions() = %d, want the leaving one counted", len(r.sessions()))
	}
	if r.withdraw(a) {
		t.Error("a second withdraw succeeded")
	}

	successor := register(t, r, "a", &tunnelpb.Route{Host: "app.test"})
	if got := agentsOf(r.table.Load().lookupHTTP("app.test")); got != "a:app.test,b:app.test" {
		t.Errorf("after a new session of the id: %s", got)
	}
	if !r.unregister(a) {
		t.Error("the leaving session's end did not unregister it")
	}
	tab = r.table.Load()
	if tab.byDialAddress(dial+":80") != nil || len(tab.lookupHTTP("app.test")) != 2 || tab.lookupHTTP("app.test")[0].agent != successor {
		t.Errorf("after the leaving session ended: %s", agentsOf(tab.lookupHTTP("app.test")))
	}
}

func TestDisplacedSessionDoesNotEvictItsSuccessor(t *testing.T) {
	r := newRegistry()
	old := register(t, r, "same", &tunnelpb.Route{Host: "app.test"})
	register(t, r, "same", &tunnelpb.Route{Host: "app.test"})
	if r.unregister(old) {
		t.Fatal("the displaced session removed its successor")
	}
	if len(r.table.Load().lookupHTTP("app.test")) != 1 {
		t.Fatal("route lost")
	}
}

func TestValidateRoutesRejects(t *testing.T) {
	_, rejected := validateRoutes([]*tunnelpb.Route{
		{Name: "dup", Host: "a.test"}, {Name: "dup", Host: "b.test"},
		{HostPattern: "("},
		{Host: "c.test", AllowedCidrs: []string{"not-a-cidr"}},
		{Host: "d.test", ListenPort: 1000},
		{ListenPort: 70000},
	})
	var reasons []string
	for _, r := range rejected {
		reasons = append(reasons, r.Name+": "+r.Reason)
	}
	got := strings.Join(reasons, "\n")
	for _, want := range []string{"dup: duplicate route name", "host_pattern", "allowed_cidrs", "listen_port: cannot be combined with host", "above 65535"} {
		if !strings.Contains(got, want) {
			t.Errorf("rejections lack %q:\n%s", want, got)
		}
	}
}

func TestAllowedFor(t *testing.T) {
	entries, _ := validateRoutes([]*tunnelpb.Route{
		{Name: "lan", AllowedCidrs: []string{"10.0.0.0/8", "::1/128"}},
		{Name: "all"},
		// IPv4-mapped, as an agent older than this check could send it:
		// clients are compared unmapped, so it means 172.16.0.0/12.
		{Name: "mapped", AllowedCidrs: []string{"::ffff:172.16.0.0/108"}},
	})
	for addr, want := range map[string]string{
		"10.1.2.3:5555":            "lan,all",
		"[::1]:80":                 "lan,all",
		"192.0.2.1:1":              "all",
		"garbage":                  "all",
		"172.16.9.9:1":             "all,mapped",
		"[::ffff:172.16.9.9]:1":    "all,mapped",
		"[::ffff:192.168.0.1]:443": "all",
	} {
		var names []string
		for _, e := range allowedFor(entries, addr) {
			names = append(names, routeName(e.route))
		}
		if got := strings.Join(names, ","); got != want {
			t.Errorf("allowedFor(%s) = %s, want %s", addr, got, want)
		}
	}
}

// TestRouteBounds: an Advertise is bounded in route count, name and host
// length, and pattern size; a pattern cannot close the anchors around it.
func TestRouteBounds(t *testing.T) {
	many := make([]*tunnelpb.Route, maxRoutesPerAdvertise+2)
	for i := range many {
		many[i] = &tunnelpb.Route{Host: fmt.Sprintf("h%d.test", i)}
	}
	ok, rejected := validateRoutes(many)
	if len(ok) != maxRoutesPerAdvertise || len(rejected) != 2 || !strings.Contains(rejected[0].GetReason(), "more than") {
		t.Errorf("%d routes: %d kept, %d rejected (%v)", len(many), len(ok), len(rejected), rejected)
	}
	for _, tc := range []struct {
		route *tunnelpb.Route
		want  string
	}{
		{&tunnelpb.Route{Host: strings.Repeat("a", 300)}, "route name longer"},
		{&tunnelpb.Route{Name: "n", Host: strings.Repeat("abcdefghi.", 26) + "com"}, "host:"},
		{&tunnelpb.Route{Name: "n", Host: "Upper.test"}, "host:"},
		{&tunnelpb.Route{Name: "n", Host: "[::1]"}, "host:"},
		{&tunnelpb.Route{HostPattern: `never\.example)|(.*`}, "host_pattern:"},
		{&tunnelpb.Route{HostPattern: `(?:.*a){1000}`}, "too complex"},
		{&tunnelpb.Route{Name: "n", HostPattern: strings.Repeat("a", hostname.MaxPatternLength+1)}, "longer than"},
	} {
		if _, rejected := validateRoutes([]*tunnelpb.Route{tc.route}); len(rejected) != 1 || !strings.Contains(rejected[0].GetReason(), tc.want) {
			t.Errorf("route %v: rejected %v, want a reason with %q", tc.route, rejected, tc.want)
		}
	}
	// A long name is echoed cut at a character boundary: a proto string
	// that is not UTF-8 would fail the ack, and with it the session.
	long := strings.Repeat("a", 201) + strings.Repeat("é", 40)
	_, rejected = validateRoutes([]*tunnelpb.Route{{Name: long, Host: "a.test"}})
	if len(rejected) != 1 || !utf8.ValidString(rejected[0].GetName()) || len(rejected[0].GetName()) > maxRouteNameLength ||
		!strings.HasPrefix(long, rejected[0].GetName()) {
		t.Errorf("long name echoed as %q", rejected)
	} else if _, err := proto.Marshal(&tunnelpb.AdvertiseAck{Rejected: rejected}); err != nil {
		t.Errorf("the ack does not marshal: %v", err)
	}
	// Patterns share one instruction budget per Advertise (these have
	// small DFAs: the node's pattern budget does not refuse them alone).
	var heavy []*tunnelpb.Route
	for i := 0; i < 100; i++ {
		heavy = append(heavy, &tunnelpb.Route{Name: fmt.Sprintf("p%d", i), HostPattern: fmt.Sprintf(`x%d[a-z]{0,120}`, i)})
	}
	ok, rejected = validateRoutes(heavy)
	if len(ok) == 0 || len(rejected) == 0 || !strings.Contains(rejected[0].GetReason(), "together") {
		t.Errorf("heavy patterns: %d kept, %d rejected (%v)", len(ok), len(rejected), rejected)
	}
	if ok, _ := validateRoutes([]*tunnelpb.Route{{Host: "::1"}, {Host: "10.0.0.1"}}); len(ok) != 2 {
		t.Error("IP address hosts must be accepted")
	}
	if ok, _ := validateRoutes([]*tunnelpb.Route{{HostPattern: `[a-z0-9-]+\.dev\.example\.com`}}); len(ok) != 1 || !ok[0].pattern.MatchString("x-1.dev.example.com") || ok[0].pattern.MatchString("x.dev.example.com.evil") {
		t.Error("an ordinary pattern must compile and match whole hosts")
	}
}

// TestRebindKeepsTheDialAddressOfUnchangedRoutes: a repeated Advertise (an
// agent retrying a rejected port, a reload re-admitting port routes) keeps
// the dial address of every route it did not change, so the transports'
// pooled connections to them stay in use; changed and new routes get
// addresses no route had before.
func TestRebindKeepsTheDialAddressOfUnchangedRoutes(t *testing.T) {
	r := newRegistry()
	a := &agentSession{agentID: "a"}
	first, rejected := validateRoutes([]*tunnelpb.Route{
		{Host: "app.test"}, {Host: "api.test", RewriteHost: "api.local"}, {Host: "old.test"},
	})
	if len(rejected) > 0 {
		t.Fatalf("rejected: %v", rejected)
	}
	r.bind(a, first, nil)
	again, rejected := validateRoutes([]*tunnelpb.Route{
		{Host: "new.test"}, {Host: "api.test", RewriteHost: "api.internal"}, {Host: "app.test"},
	})
	if len(rejected) > 0 {
		t.Fatalf("rejected: %v", rejected)
	}
	r.bind(a, again, first)

	if again[2].dial != first[0].dial {
		t.Errorf("unchanged app.test: dial %q, was %q", again[2].dial, first[0].dial)
	}
	before := map[string]bool{}
	for _, e := range first {
		before[e.dial] = true
	}
	for _, e := range again[:2] {
		if before[e.dial] {
			t.Errorf("%s (new or changed) got an earlier dial address %q", routeName(e.route), e.dial)
		}
	}
	if again[0].dial == again[1].dial {
		t.Errorf("two routes share dial address %q", again[0].dial)
	}
	for _, e := range again {
		if e.agent != a {
			t.Fatalf("entry %s not bound to its session", routeName(e.route))
		}
	}
}

// TestPatternBudget: the node's pattern budget is shared by every session.
// A pattern that does not fit is rejected with the reason while the
// agent's other routes stay up; a pattern some route has already costs
// only its walk; the budget comes back when a session ends or advertises
// again.
func TestPatternBudget(t *testing.T) {
	r := newRegistry()
	m, _, _ := compileHostMatcher(`[a-z]+\.p0\.test`)
	fit := patternBudget / (m.cost + patternEntryCost)
	var full []*tunnelpb.Route
	for i := range fit {
		full = append(full, &tunnelpb.Route{HostPattern: fmt.Sprintf(`[a-z]+\.p%d\.test`, i)})
	}
	a := &agentSession{agentID: "a"}
	if rejected := advertise(t, r, a, full...); len(rejected) != 0 {
		t.Fatalf("%d patterns within the budget: rejected %v", fit, rejected)
	}
	b := &agentSession{agentID: "b"}
	rejected := advertise(t, r, b, &tunnelpb.Route{Host: "b.test"}, &tunnelpb.Route{Name: "more", HostPattern: `[a-z]+\.more\.test`},
		&tunnelpb.Route{Name: "same", HostPattern: `[a-z]+\.p0\.test`})
	if len(rejected) != 1 || rejected[0].GetName() != "more" || !strings.Contains(rejected[0].GetReason(), "pattern budget") {
		t.Fatalf("over the budget: rejected %v, want `more` alone, for the budget", rejected)
	}
	tab := r.table.Load()
	if got := agentsOf(tab.lookupHTTP("x.p0.test")); got != `a:[a-z]+\.p0\.test,b:same` {
		t.Errorf("a pattern already paid for: lookup = %s", got)
	}
	if len(tab.lookupHTTP("b.test")) != 1 || len(tab.lookupHTTP("x.more.test")) != 0 {
		t.Error("the other routes of the agent must stay up, the rejected one down")
	}
	if tab.load.total > patternBudget {
		t.Errorf("load %d over the budget %d", tab.load.total, patternBudget)
	}
	// A repeated Advertise gives back what it replaces.
	if rejected := advertise(t, r, a, full...); len(rejected) != 0 {
		t.Errorf("the same routes again: rejected %v", rejected)
	}
	if rejected := advertise(t, r, a, full[1:]...); len(rejected) != 0 {
		t.Fatalf("fewer routes: rejected %v", rejected)
	}
	if rejected := advertise(t, r, b, &tunnelpb.Route{Host: "b.test"}, &tunnelpb.Route{Name: "more", HostPattern: `[a-z]+\.more\.test`}); len(rejected) != 0 {
		t.Errorf("after a re-advertised fewer patterns: rejected %v", rejected)
	}
	// A session's end gives back all it held.
	c := &agentSession{agentID: "c"}
	if rejected := advertise(t, r, c, &tunnelpb.Route{HostPattern: `[a-z]+\.c\.test`}); len(rejected) != 1 {
		t.Fatalf("the budget is spent again: rejected %v", rejected)
	}
	r.unregister(a)
	if rejected := advertise(t, r, c, &tunnelpb.Route{HostPattern: `[a-z]+\.c\.test`}); len(rejected) != 0 {
		t.Errorf("after a's end: rejected %v", rejected)
	}
	if want := 2 * (m.cost + patternEntryCost); r.table.Load().load.total != want { // b's `more`, c's
		t.Errorf("load %d after a's end, want %d", r.table.Load().load.total, want)
	}
}

// TestPatternBudgetAtFullLoad: filled by many agents with the most costly
// patterns each engine admits, the node's worst-case cost for one lookup,
// counted anew from its distinct patterns, stays within patternBudget,
// which stays within the 50 µs the issue allows (units are about 1 ns;
// see hostmatch.go).
func TestPatternBudgetAtFullLoad(t *testing.T) {
	const lookupBoundUnits = 50_000
	if patternBudget > lookupBoundUnits/2 {
		t.Fatalf("patternBudget %d leaves no margin under %d", patternBudget, lookupBoundUnits)
	}
	r := fillPatternBudget(t, newRegistry())
	tab := r.table.Load()
	distinct := map[*hostMatcher]bool{}
	worst := 0
	for _, e := range tab.patterns.entries {
		worst += patternEntryCost
		if !distinct[e.pattern] {
			distinct[e.pattern] = true
			worst += e.pattern.cost
			if m, insts, _ := compileHostMatcher(e.pattern.source); m.dfa == nil && m.cost != regexpStepCost*insts*(hostKeyMax+1) {
				t.Errorf("%s: cost %d is not its regexp's worst case", m, m.cost)
			}
		}
	}
	if worst > patternBudget || worst != tab.load.total || worst < patternBudget-2000 {
		t.Errorf("worst case %d (table load %d) for budget %d", worst, tab.load.total, patternBudget)
	}
	if len(tab.patterns.matchers) != len(distinct) {
		t.Errorf("%d matchers for %d distinct patterns", len(tab.patterns.matchers), len(distinct))
	}
}

// fillPatternBudget registers agents advertising the costliest patterns
// the node admits (a regexp at the edge of the budget, then DFAs that no
// host leaves early) until the budget refuses one.
func fillPatternBudget(tb testing.TB, r *registry) *registry {
	tb.Helper()
	routes := []*tunnelpb.Route{{HostPattern: `\b(?:.*a)*.*z`}}
	for i := range 200 {
		routes = append(routes, &tunnelpb.Route{HostPattern: fmt.Sprintf(`[a-z0-9.-]*q%d`, i)})
	}
	refused := 0
	for i := 0; len(routes) > 0; i++ {
		a := &agentSession{agentID: fmt.Sprintf("agent%03d", i)}
		n := min(len(routes), 7)
		entries, rejected := validateRoutes(routes[:n])
		if len(rejected) > 0 {
			tb.Fatalf("validation rejected %v", rejected)
		}
		entries, rejected = r.bind(a, entries, nil)
		r.register(a, entries)
		refused += len(rejected)
		routes = routes[n:]
	}
	if refused == 0 {
		tb.Fatal("the budget refused nothing")
	}
	return r
}

// TestTableHasAPlaceForEveryKind: the route table puts a route where its
// kind (route.Classify) says it is reached, and only there. A kind added to
// route.Kinds without an example here, or without a case in
// tableBuilder.add (it would be found by name only), fails.
func TestTableHasAPlaceForEveryKind(t *testing.T) {
	examples := map[route.Kind]struct {
		route  *tunnelpb.Route
		places string
	}{
		route.Host:               {&tunnelpb.Route{Host: "h.test", Target: "http://x:1"}, "http-host name"},
		route.HostPattern:        {&tunnelpb.Route{HostPattern: `.*\.p\.test`, Target: "http://x:1"}, "http-pattern name"},
		route.CatchAll:           {&tunnelpb.Route{Target: "http://x:1"}, "catch-all name"},
		route.TCPHost:            {&tunnelpb.Route{Host: "t.test", Target: "tcp://x:1"}, "http-host sni-host name"},
		route.TCPHostPattern:     {&tunnelpb.Route{HostPattern: `.*\.tp\.test`, Target: "tcp://x:1"}, "http-pattern sni-pattern name"},
		route.PassthroughHost:    {&tunnelpb.Route{Host: "s.test", TlsPassthrough: true, Target: "tcp://x:1"}, "sni-host name"},
		route.PassthroughPattern: {&tunnelpb.Route{HostPattern: `.*\.sp\.test`, TlsPassthrough: true, Target: "tcp://x:1"}, "sni-pattern name"},
		route.NamedTCP:           {&tunnelpb.Route{Name: "redis", Target: "tcp://x:1"}, "name"},
		route.ListenPort:         {&tunnelpb.Route{ListenPort: 2222, Target: "tcp://x:1"}, "port name"},
		route.NamedUDP:           {&tunnelpb.Route{Name: "dns", Target: "udp://x:53"}, "name"},
		route.UDPListenPort:      {&tunnelpb.Route{ListenPort: 5353, Target: "udp://x:53"}, "udp-port name"},
	}
	for _, k := range route.Kinds() {
		ex, ok := examples[k]
		if !ok {
			t.Errorf("kind %v: no example route here; give it one and a place in tableBuilder.add", k)
			continue
		}
		if got, err := route.Classify(ex.route); got != k || err != nil {
			t.Errorf("kind %v: its example classifies as %v, %v", k, got, err)
			continue
		}
		r := newRegistry()
		e := register(t, r, "a", ex.route).routes[0]
		places := placesOf(r.table.Load(), e)
		if e.kind != k || places != ex.places {
			t.Errorf("kind %v: entry of kind %v found in %q, want %q", k, e.kind, places, ex.places)
		}
		if http := strings.Contains(places, "http-") || strings.Contains(places, "catch-all"); http != k.TakesHTTP() {
			t.Errorf("kind %v: in an HTTP index %v, but TakesHTTP() is %v", k, http, k.TakesHTTP())
		}
	}
}

// placesOf lists the indexes of t that hold e, in a fixed order (byDial,
// which holds every route, is left out).
func placesOf(t *routeTable, e *routeEntry) string {
	has := func(es []*routeEntry) bool { return slices.Contains(es, e) }
	inMap := func(m *shardedMap[string, []*routeEntry]) bool {
		for _, es := range m.all() {
			if has(es) {
				return true
			}
		}
		return false
	}
	inPorts, inUDPPorts := false, false
	for _, es := range t.byPort.all() {
		inPorts = inPorts || has(es)
	}
	for _, es := range t.byUDPPort.all() {
		inUDPPorts = inUDPPorts || has(es)
	}
	var places []string
	for _, p := range []struct {
		in   bool
		name string
	}{
		{inMap(&t.exact), "http-host"}, {has(t.patterns.entries), "http-pattern"}, {has(t.catchAll), "catch-all"},
		{inMap(&t.sniExact), "sni-host"}, {has(t.sniPatterns.entries), "sni-pattern"},
		{inPorts, "port"}, {inUDPPorts, "udp-port"}, {inMap(&t.byName), "name"},
	} {
		if p.in {
			places = append(places, p.name)
		}
	}
	return strings.Join(places, " ")
}
