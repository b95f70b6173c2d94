package caddymodule

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/sluice-tunnel/sluice/internal/hostname"
	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// dialSuffix ends every dial address the upstream source hands to Caddy.
// An address is "r<route>.s<generation>.sluice:80": it names one route of one
// session, so Caddy's connection pools never mix routes or outlive a
// reconnect.
const dialSuffix = ".sluice"

// agentKey names an agent on the node: its id within its credential
// ("" for the unscoped token), so an agent of one credential never
// displaces another's of the same id.
type agentKey struct{ credential, id string }

// compareAgents orders sessions as routing does: by agent id, then by
// credential name. The order does not depend on when agents connected,
// so every node of a cluster decides the same.
func compareAgents(a, b *agentSession) int {
	if c := strings.Compare(a.agentID, b.agentID); c != 0 {
		return c
	}
	return strings.Compare(a.credName, b.credName)
}

// agentSession is one registered agent stream.
type agentSession struct {
	agentID   string
	sess      *tunnelcore.Session
	remote    string
	build     string
	connected time.Time
	// displaced is set when this session replaced an earlier one of its
	// id at registration (guarded by node.admitMu).
	displaced bool
	routes    []*routeEntry
	// credName is its credential's name ("" for the unscoped token).
	credName string
	// auth is how it authenticated: a reload that makes that invalid ends
	// it, one that changes its credential's scope re-admits its routes
	// (node.applyCredentials). Guarded by node.admitMu, which replaces
	// auth.cred with the reload's credential of the same name.
	auth authn
	// overlaps is what the last AdvertiseAck said about routes shared
	// with other credentials' agents (overlapsKey), so an ack is sent
	// again only when that changes. Guarded by node.admitMu.
	overlaps string
	// rejected is what the last AdvertiseAck rejected, sent again with a
	// later ack that only tells of changed overlaps. Guarded by
	// node.admitMu.
	rejected []*tunnelpb.RejectedRoute
	// members is the cluster membership the session was last told of
	// (membership.key; "": none), so a reload that does not change it
	// tells nothing. Guarded by node.admitMu.
	members string
	lane    bool // its frames run on the data lane the agent attached, not the gRPC stream
	idValue any  // agentID, boxed once for the request placeholders (setServedBy)
	// endedToClients and endedFromClients are the payload bytes of the
	// session's connections that ended (node.connEnded).
	endedToClients, endedFromClients atomic.Int64

	// advertised is the agent's last Advertise, re-admitted when a reload
	// changes the port options. Guarded by node.admitMu.
	advertised []*tunnelpb.Route
	// leaving is set when the agent sent Drain: it is shutting down, and
	// its routes take no new requests (registry.withdraw).
	leaving atomic.Bool
	// opening counts node.open calls in progress (startOpen); ended is
	// set, under endMu, once a leaving session was found idle and is being
	// ended (endIfIdle): no open starts after that.
	endMu   sync.Mutex
	ended   bool
	opening atomic.Int32
	// requests counts the requests of the sluice transport in flight on
	// the session, from RoundTrip to the response body's Close. sweepMu
	// is held for reading by a RoundTrip until it returns, and for writing
	// by closeIdleHTTP.
	requests atomic.Int64
	sweepMu  sync.RWMutex

	// readv paces the agent's repeated Advertises (node.readvertise).
	readv struct {
		mu      sync.Mutex
		last    time.Time         // when the last one was admitted
		pending []*tunnelpb.Route // the latest one waiting for its turn
		waiting bool              // pending is set, and a timer will admit it
	}
}

// routeEntry is one route of one agent session.
type routeEntry struct {
	agent   *agentSession
	route   *tunnelpb.Route
	kind    route.Kind     // route.Classify's: where the table puts it
	pattern *hostMatcher   // compiled host_pattern, nil otherwise
	allowed []netip.Prefix // allowed_cidrs; empty allows every client
	// within bounds what a pattern route of a scoped credential matches
	// (scope.admitPattern); nil: unbounded.
	within *nameSet
	// nameOutOfScope: the route's name is not among its scoped
	// credential's services, so layer4's `sluice NAME` never reaches it by
	// that name (reachableByName), whatever kind of route carries it.
	nameOutOfScope bool
	dial           string // host part of the dial address
	// nameValue is the route's name, boxed once for the request
	// placeholders (setServedBy).
	nameValue any
	// active counts the TCP relays and datagram flows open on the route
	// (layer4 lb_policy least_conn, lbpolicy.go); read and change it
	// through conns.
	active atomic.Int64
	// activeOn, when set, is the counter of the entry this one replaced
	// for the same route on a repeated Advertise (bind): the relays
	// opened on the old entry end on it, so the route's count must stay
	// that one, or a re-advertising agent (its rejected routes retried)
	// would look idle to least_conn while its connections run.
	activeOn *atomic.Int64
}

// conns is the counter of the connections open on e's route (see
// routeEntry.active).
func (e *routeEntry) conns() *atomic.Int64 {
	if e.activeOn != nil {
		return e.activeOn
	}
	return &e.active
}

// allows reports whether a client address (host:port or host) may use the
// route.
func (e *routeEntry) allows(addr string) bool {
	if len(e.allowed) == 0 {
		return true
	}
	ip, err := netip.ParseAddr(addrHost(addr))
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	for _, p := range e.allowed {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// allowedFor keeps the routes addr may use.
func allowedFor(routes []*routeEntry, addr string) []*routeEntry {
	for i, e := range routes {
		if !e.allows(addr) {
			out := append([]*routeEntry(nil), routes[:i]...)
			for _, e := range routes[i+1:] {
				if e.allows(addr) {
					out = append(out, e)
				}
			}
			return out
		}
	}
	return routes
}

// matchesByPattern reports whether the route serves the hosts its pattern
// matches (by HTTP host or TLS server name): its patterns count against
// the node's pattern budget.
func (e *routeEntry) matchesByPattern() bool {
	switch e.kind {
	case route.HostPattern, route.TCPHostPattern, route.PassthroughPattern:
		return true
	}
	return false
}

// routeTable is an immutable snapshot of every route; a new one is built on
// each registration change and swapped in atomically.
type routeTable struct {
	// The keyed indexes are sharded (shardedMap), so that a change
	// copies only the shards its routes touch (nextTable).
	exact    shardedMap[string, []*routeEntry] // by host, ordered by agent id
	patterns patternIndex                      // ordered by agent id, then advertise order
	catchAll []*routeEntry                     // ordered by agent id
	byDial   shardedMap[string, *routeEntry]

	sniExact    shardedMap[string, []*routeEntry] // TCP routes by server name
	sniPatterns patternIndex
	byPort      shardedMap[uint32, []*routeEntry] // listen-port routes
	byUDPPort   shardedMap[uint32, []*routeEntry] // udp:// listen-port routes
	byName      shardedMap[string, []*routeEntry] // every route by name
	bySource    map[string][]*routeEntry          // pattern routes by patternKey

	// load is the worst-case cost of the pattern routes of the table's
	// sessions for one lookup (patternBudget bounds it, bind keeps it
	// so), and matchers their distinct patterns by source, which
	// sessions advertising the same pattern share.
	load     patternLoad
	matchers map[string]*hostMatcher

	// replaced is closed when a newer table takes this one's place, so a
	// request can wait for an agent to come (lb_try_duration).
	replaced chan struct{}
}

// registry holds the agent sessions of one node, by agent key.
type registry struct {
	mu     sync.Mutex
	agents map[agentKey]*agentSession
	// leaving holds the sessions whose agent is shutting down (withdraw):
	// no longer their id's session, routing nothing new, until they end.
	leaving map[*agentSession]struct{}
	nextGen atomic.Uint64
	table   atomic.Pointer[routeTable]
}

func newRegistry() *registry {
	r := &registry{agents: make(map[agentKey]*agentSession), leaving: make(map[*agentSession]struct{})}
	r.table.Store(emptyTable())
	return r
}

// Bounds on what one Advertise may ask of the node. Every agent holding
// the token may advertise, and each pattern runs for every request whose
// host no exact route serves: the bounds keep one agent from costing the
// node unbounded memory at admission or CPU per request.
const (
	// maxRoutesPerAdvertise: routes past it are rejected.
	maxRoutesPerAdvertise = tunnelpb.MaxRoutesPerAdvertise
	// maxAdvertiseInsts bounds the compiled patterns of one Advertise
	// together (hostname.MaxPatternInsts bounds each).
	maxAdvertiseInsts = tunnelpb.MaxAdvertisePatternInsts
	// maxRouteNameLength bounds a route name (it is echoed in acks, logs
	// and Connect frames).
	maxRouteNameLength = tunnelpb.MaxRouteNameLength
)

// validateRoutes compiles the advertised routes. Invalid ones are returned
// as rejected with the reason.
func validateRoutes(routes []*tunnelpb.Route) (ok []*routeEntry, rejected []*tunnelpb.RejectedRoute) {
	seen := map[string]bool{}
	insts := 0
	for i, rt := range routes {
		name := routeName(rt)
		tooLong := len(name) > maxRouteNameLength
		if tooLong {
			name = cutUTF8(name, maxRouteNameLength) // as echoed in the rejection
		}
		reject := func(reason string) {
			rejected = append(rejected, &tunnelpb.RejectedRoute{Name: name, ListenPort: rt.GetListenPort(), Reason: reason})
		}
		if i >= maxRoutesPerAdvertise {
			reject(fmt.Sprintf("more than %d routes in one Advertise", maxRoutesPerAdvertise))
			continue
		}
		if tooLong {
			reject(fmt.Sprintf("route name longer than %d bytes", maxRouteNameLength))
			continue
		}
		if seen[name] {
			reject("duplicate route name")
			continue
		}
		seen[name] = true
		e := &routeEntry{route: rt, nameValue: name}
		if h := rt.GetHost(); h != "" && !hostname.ValidRoute(h) {
			reject(fmt.Sprintf("host: %q is not a lower-case host name or IP address of at most %d bytes", h, hostname.MaxLength))
			continue
		}
		if p := rt.GetHostPattern(); p != "" {
			m, n, err := compileHostMatcher(p)
			switch {
			case err != nil:
			case m.cost+patternEntryCost > patternBudget:
				err = fmt.Errorf("too costly to match: its worst case (%d units, see hostmatch.go) exceeds the node's pattern budget of %d alone", m.cost, patternBudget)
			case insts+n > maxAdvertiseInsts:
				err = fmt.Errorf("the patterns of one Advertise compile to more than %d instructions together", maxAdvertiseInsts)
			}
			if err != nil {
				reject(fmt.Sprintf("host_pattern: %v", err))
				continue
			}
			insts += n
			e.pattern = m
		}
		badCIDR := ""
		for _, c := range rt.GetAllowedCidrs() {
			p, err := netip.ParsePrefix(c)
			if err != nil {
				badCIDR = c
				break
			}
			e.allowed = append(e.allowed, unmappedPrefix(p))
		}
		if badCIDR != "" {
			reject(fmt.Sprintf("allowed_cidrs: %q is not a CIDR prefix", badCIDR))
			continue
		}
		kind, err := route.Classify(rt)
		if err != nil {
			reject(err.Error()) // "listen_port: cannot be combined with host", ...
			continue
		}
		e.kind = kind
		if rt.GetListenPort() > 65535 {
			reject("listen_port above 65535")
			continue
		}
		ok = append(ok, e)
	}
	return ok, rejected
}

// routeName is the name a route goes by in Connect frames (route.Name).
func routeName(rt *tunnelpb.Route) string {
	return route.Name(rt)
}

// bind ties entries to their session and names each with a dial address.
// An entry whose route equals one of previous (the session's routes before
// a repeated Advertise) keeps that route's address, so the transports'
// pooled connections to it stay usable, and its connection count (conns,
// for least_conn); the others get addresses of a
// fresh generation. It runs before the entries are published anywhere
// (port claims, the route table), which then only read them.
//
// First it spends the node's pattern budget on the entries' patterns
// (spendPatternBudget): a pattern route that does not fit is returned
// rejected, unbound; kept are the others. Callers hold node.admitMu from
// bind to the register or reroute that publishes kept, so the budget bind
// counted on is still there.
func (r *registry) bind(a *agentSession, entries, previous []*routeEntry) (kept []*routeEntry, rejected []*tunnelpb.RejectedRoute) {
	entries, rejected = r.spendPatternBudget(a, entries)
	var gen uint64
	// Previous routes by their bytes: matching them pairwise took a
	// noticeable time under admitMu for an Advertise of 1024 routes.
	unused := make(map[string][]*routeEntry, len(previous))
	for _, p := range previous {
		k := routeBytes(p.route)
		unused[k] = append(unused[k], p)
	}
	for i, e := range entries {
		e.agent = a
		k := routeBytes(e.route)
		if same := unused[k]; len(same) > 0 {
			e.dial, e.activeOn = same[0].dial, same[0].conns()
			unused[k] = same[1:]
			continue
		}
		if gen == 0 {
			gen = r.nextGen.Add(1)
		}
		e.dial = "r" + strconv.Itoa(i) + ".s" + strconv.FormatUint(gen, 10) + dialSuffix
	}
	return entries, rejected
}

// spendPatternBudget keeps, in advertise order, the entries whose patterns
// fit in what the node's pattern budget has left once the routes a
// replaces (its own on a repeated Advertise, or those of the session of
// its id it displaces) are given back; the others are returned rejected.
// A pattern some other route has already costs only its walk (see
// patternLoad). Kept entries share the table's matcher of their pattern,
// so a pattern's DFA is in memory once however many routes use it.
func (r *registry) spendPatternBudget(a *agentSession, entries []*routeEntry) ([]*routeEntry, []*tunnelpb.RejectedRoute) {
	if !slices.ContainsFunc(entries, (*routeEntry).matchesByPattern) {
		return entries, nil
	}
	load, shared := r.loadWithout(a.key())
	kept := make([]*routeEntry, 0, len(entries))
	var rejected []*tunnelpb.RejectedRoute
	for _, e := range entries {
		if e.matchesByPattern() {
			if load.total+load.costOf(e.pattern) > patternBudget {
				rejected = append(rejected, &tunnelpb.RejectedRoute{Name: routeName(e.route),
					Reason: fmt.Sprintf("host_pattern: the node's pattern budget (%d cost units across all agents) is spent", patternBudget)})
				continue
			}
			if m := shared[e.pattern.source]; m != nil {
				e.pattern = m
			}
			load.add(e.pattern)
		}
		kept = append(kept, e)
	}
	return kept, rejected
}

// loadWithout returns the pattern load of the registered sessions but
// key's, and the current table's matchers.
func (r *registry) loadWithout(key agentKey) (patternLoad, map[string]*hostMatcher) {
	r.mu.Lock()
	defer r.mu.Unlock()
	t := r.table.Load()
	load := patternLoad{uses: maps.Clone(t.load.uses), total: t.load.total}
	if cur := r.agents[key]; cur != nil {
		for _, e := range cur.routes {
			if e.matchesByPattern() {
				load.remove(e.pattern)
			}
		}
	}
	return load, t.matchers
}

// routeBytes is rt's deterministic encoding: two routes are the same route
// when their encodings are.
func routeBytes(rt *tunnelpb.Route) string {
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(rt)
	return string(b)
}

// register adds a session for agentID, replacing any earlier session of the
// same agent (which is left to end by itself).
func (r *registry) register(a *agentSession, entries []*routeEntry) (replaced *agentSession) {
	r.mu.Lock()
	a.routes = entries
	defer r.mu.Unlock()
	replaced = r.agents[a.key()]
	r.agents[a.key()] = a
	c := tableChange{in: entries, dial: entries}
	if replaced != nil {
		c.out, c.undial = replaced.routes, replaced.routes
	}
	r.applyLocked(c)
	return replaced
}

// unregister removes a when it ends, only if it is still the agent's
// current session (so a displaced session's late end never evicts its
// successor) or a leaving one. It reports whether a was either.
func (r *registry) unregister(a *agentSession) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.leaving[a]; ok {
		delete(r.leaving, a)
		r.applyLocked(tableChange{undial: a.routes})
		return true
	}
	if r.agents[a.key()] != a {
		return false
	}
	delete(r.agents, a.key())
	r.applyLocked(tableChange{out: a.routes, undial: a.routes})
	return true
}

// withdraw takes the routes of a, whose agent is shutting down, out of
// every lookup, so new requests and connections go to other agents (or get
// the no-agent answer), while a's dial addresses stay valid: a request that
// picked a just before keeps its way to it, and the agent serves what is
// open until the node ends the session (node.endWhenIdle). A newer session
// of the same id then registers without displacing a. It reports whether a
// was registered.
func (r *registry) withdraw(a *agentSession) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.agents[a.key()] != a {
		return false
	}
	delete(r.agents, a.key())
	r.leaving[a] = struct{}{}
	a.leaving.Store(true)
	r.applyLocked(tableChange{out: a.routes})
	return true
}

// tableChange is one registration change of the route table: the routes
// that leave (out) and enter (in) the lookups, and those whose dial
// addresses end (undial) and begin (dial). A leaving session's routes
// leave the lookups but keep their dial addresses until it ends.
type tableChange struct {
	out, in      []*routeEntry
	undial, dial []*routeEntry
}

// applyLocked publishes the current table changed by c. Its cost is
// proportional to c's routes and the lists of the keys they touch (plus
// copying the touched shards), not to the table: connecting N agents one
// after the other used to rebuild the whole table each time, O(N²) in all.
// Only a change of pattern or catch-all routes rebuilds those parts, from
// every registered session. Callers hold r.mu.
func (r *registry) applyLocked(c tableChange) {
	old := r.table.Load()
	r.table.Store(nextTable(old, c, r.sortedAgentsLocked))
	close(old.replaced)
}

// rebuildLocked builds the table anew from the registered sessions (a
// benchmark's bulk registration). Callers hold r.mu.
func (r *registry) rebuildLocked() {
	leaving := make([]*agentSession, 0, len(r.leaving))
	for a := range r.leaving {
		leaving = append(leaving, a)
	}
	old := r.table.Swap(buildTable(r.sortedAgentsLocked(), leaving))
	close(old.replaced)
}

// sortedAgentsLocked returns the registered sessions in routing order.
func (r *registry) sortedAgentsLocked() []*agentSession {
	agents := make([]*agentSession, 0, len(r.agents))
	for _, a := range r.agents {
		agents = append(agents, a)
	}
	slices.SortFunc(agents, compareAgents)
	return agents
}

// emptyTable is the table of no routes.
func emptyTable() *routeTable {
	t := &routeTable{replaced: make(chan struct{}), bySource: map[string][]*routeEntry{}, matchers: map[string]*hostMatcher{}}
	t.sniPatterns.first = true // see lookupSNI
	return t
}

// buildTable indexes the routes of agents; those of leaving sessions only by
// dial address.
func buildTable(agents, leaving []*agentSession) *routeTable {
	slices.SortFunc(agents, compareAgents)
	var c tableChange
	for _, a := range leaving {
		c.dial = append(c.dial, a.routes...)
	}
	for _, a := range agents {
		c.in = append(c.in, a.routes...)
	}
	c.dial = append(c.dial, c.in...)
	return nextTable(emptyTable(), c, func() []*agentSession { return agents })
}

// nextTable returns a new table: old changed by c. It shares with old what
// c does not touch: the shards of its keyed indexes, and the pattern
// indexes (with their lookup caches) and catch-all list unless c changes
// a pattern or catch-all route; then agents (in routing order) rebuilds
// them.
func nextTable(old *routeTable, c tableChange, agents func() []*agentSession) *routeTable {
	t := *old
	t.replaced = make(chan struct{})
	dials := shardWriter[string, *routeEntry]{m: &t.byDial}
	for _, e := range c.undial {
		if t.byDial.get(e.dial) == e { // a reroute's kept route has its dial address again
			dials.delete(e.dial)
		}
	}
	for _, e := range c.dial {
		dials.set(e.dial, e)
	}
	b := newTableBuilder(&t, len(c.out))
	b.lists, b.removing = true, true
	for _, e := range c.out {
		b.out[e] = true
		b.add(e)
	}
	b.removing = false
	for _, e := range c.in {
		b.add(e)
	}
	b.flushLists()
	if slices.ContainsFunc(c.out, needsRebuild) || slices.ContainsFunc(c.in, needsRebuild) {
		b.rebuildPatterns(agents())
	}
	return &t
}

// needsRebuild reports whether a change of e rebuilds the table's pattern
// indexes and catch-all list, which are not keyed (nextTable).
func needsRebuild(e *routeEntry) bool { return e.matchesByPattern() || e.kind == route.CatchAll }

// tableBuilder fills a new routeTable (nextTable) in two passes. The
// keyed pass (lists) records, for the changed routes only, the keys whose
// lists lose (removing) or gain routes, then writes them (flushLists). The
// pattern pass (patterns) rebuilds the unkeyed parts from every registered
// route. The HTTP and SNI pattern indexes share their distinct patterns
// (groups, distinct), so a pattern of both runs once per lookup cache miss
// of each.
type tableBuilder struct {
	t        *routeTable
	groups   map[string]int
	distinct []*hostMatcher

	lists, removing, patterns bool
	out                       map[*routeEntry]bool // the routes leaving the lists
	exact, sniExact, byName   pendingLists[string]
	byPort, byUDPPort         pendingLists[uint32]
}

func newTableBuilder(t *routeTable, out int) *tableBuilder {
	return &tableBuilder{t: t, out: make(map[*routeEntry]bool, out),
		exact: pendingLists[string]{}, sniExact: pendingLists[string]{}, byName: pendingLists[string]{},
		byPort: pendingLists[uint32]{}, byUDPPort: pendingLists[uint32]{}}
}

// add indexes e by name and where its kind is reached: the one place that
// maps a route.Kind to the lookups that find it (every kind has a case;
// TestTableHasAPlaceForEveryKind checks). The keyed indexes go through
// pend, which records the change of the key's list; the others are
// written in the pattern pass only.
func (b *tableBuilder) add(e *routeEntry) {
	t := b.t
	pend(b, b.byName, routeName(e.route), e)
	if b.patterns && e.matchesByPattern() {
		t.bySource[patternKey(e)] = append(t.bySource[patternKey(e)], e)
		t.load.add(e.pattern)
		if t.matchers[e.pattern.source] == nil {
			t.matchers[e.pattern.source] = e.pattern
		}
	}
	switch e.kind {
	case route.Host:
		b.addHTTPHost(e)
	case route.TCPHost:
		b.addSNIHost(e)
		b.addHTTPHost(e)
	case route.HostPattern:
		b.addPattern(&t.patterns, e)
	case route.TCPHostPattern:
		b.addPattern(&t.sniPatterns, e)
		b.addPattern(&t.patterns, e)
	case route.CatchAll:
		if b.patterns {
			t.catchAll = append(t.catchAll, e)
		}
	case route.PassthroughHost:
		b.addSNIHost(e)
	case route.PassthroughPattern:
		b.addPattern(&t.sniPatterns, e)
	case route.NamedTCP:
		// Reached by its name alone (byName, above).
	case route.ListenPort:
		pend(b, b.byPort, e.route.GetListenPort(), e)
	case route.NamedUDP:
		// Reached by its name alone, from a layer4 UDP server (byName).
	case route.UDPListenPort:
		pend(b, b.byUDPPort, e.route.GetListenPort(), e)
	}
}

// addHTTPHost indexes e by its host for HTTP requests.
func (b *tableBuilder) addHTTPHost(e *routeEntry) {
	pend(b, b.exact, strings.ToLower(e.route.GetHost()), e)
}

// addSNIHost indexes e by its host for TLS server names.
func (b *tableBuilder) addSNIHost(e *routeEntry) {
	pend(b, b.sniExact, strings.ToLower(e.route.GetHost()), e)
}

// addPattern appends e to a pattern index in the pattern pass.
func (b *tableBuilder) addPattern(x *patternIndex, e *routeEntry) {
	if b.patterns {
		x.add(e, b.groups, &b.distinct)
	}
}

// flushLists writes the keyed pass's changes into the table.
func (b *tableBuilder) flushLists() {
	t := b.t
	applyLists(&t.exact, b.exact, b.out)
	applyLists(&t.sniExact, b.sniExact, b.out)
	applyLists(&t.byName, b.byName, b.out)
	applyLists(&t.byPort, b.byPort, b.out)
	applyLists(&t.byUDPPort, b.byUDPPort, b.out)
}

// rebuildPatterns rebuilds the table's unkeyed parts (pattern indexes,
// catch-all list, pattern load and matchers) from the routes of agents,
// in routing order, and hands the pattern indexes their shared matchers
// and fresh lookup caches.
func (b *tableBuilder) rebuildPatterns(agents []*agentSession) {
	t := b.t
	t.patterns, t.sniPatterns = patternIndex{}, patternIndex{first: true} // see lookupSNI
	t.catchAll, t.load = nil, patternLoad{}
	t.bySource, t.matchers = map[string][]*routeEntry{}, map[string]*hostMatcher{}
	b.groups, b.distinct = map[string]int{}, nil
	b.lists, b.patterns = false, true
	for _, a := range agents {
		for _, e := range a.routes {
			if needsRebuild(e) {
				b.add(e)
			}
		}
	}
	t.patterns.matchers, t.sniPatterns.matchers = b.distinct, b.distinct
	if len(b.distinct) > 0 {
		t.patterns.cache, t.sniPatterns.cache = newLookupCache(), newLookupCache()
	}
}

// lookupHTTP returns the routes serving host, ordered by agent id: exact
// host routes if any, else the host patterns that match, else the
// catch-all routes.
//
// It needs every matching pattern route, not the first: the upstream
// source cannot know the handler's lb_policy (`dynamic sluice` may serve
// a plain reverse_proxy with any), and even Caddy's `first` takes the next
// upstream when the first is unavailable (passive health checks,
// max_requests) or refused by allowed_cidrs (allowedFor). The table's
// cache makes a repeated host cost one lookup.
func (t *routeTable) lookupHTTP(host string) []*routeEntry {
	if es := t.exact.get(host); len(es) > 0 {
		return es
	}
	if len(host) <= hostKeyMax { // a routing key always is (hostname.RoutingKey)
		if es := t.patterns.lookup(host); len(es) > 0 {
			return es
		}
	}
	return t.catchAll
}

// lookupSNI returns the TCP routes for a TLS server name: the exact host
// routes, ordered by agent id, else the first pattern route that matches
// (by agent id). The pattern lookup stops at that first match because
// lb_policy first (the default) needs no other; a spreading policy widens
// it to every agent's route of the same pattern (sniPeers, from
// resolveTCP), which costs a map lookup rather than another pattern walk.
// A name that is not a valid host name (RFC 6066 allows no other, and a
// ClientHello may carry up to 64 KiB of anything) matches no pattern, so
// a pattern never runs on more than hostKeyMax bytes.
func (t *routeTable) lookupSNI(name string) []*routeEntry {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	if es := t.sniExact.get(name); len(es) > 0 || !hostname.Valid(name) {
		return es
	}
	return t.sniPatterns.lookup(name)
}

// lookupName returns the routes named name (or, failing that, serving the
// host name), ordered by agent id.
func (t *routeTable) lookupName(name string) []*routeEntry {
	if es := reachableByName(t.byName.get(name)); len(es) > 0 {
		return es
	}
	if es := t.exact.get(strings.ToLower(name)); len(es) > 0 {
		return es
	}
	return t.lookupSNI(name)
}

// byDialAddress finds the route a dial address names ("r0.s3.sluice:80").
func (t *routeTable) byDialAddress(addr string) *routeEntry {
	host := addr
	if i := strings.LastIndexByte(addr, ':'); i >= 0 {
		host = addr[:i]
	}
	return t.byDial.get(host)
}

// succeeds reports whether a new session of key replaces one: the key's
// registered session, or else its one leaving session (a restart, a
// rolling update). A second leaving session of the key does not count, so
// leaving and coming back cannot pile sessions up past max_sessions.
func (r *registry) succeeds(key agentKey) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.agents[key]; ok {
		return true
	}
	n := 0
	for a := range r.leaving {
		if a.key() == key {
			n++
		}
	}
	return n == 1
}

// sessions returns the agent sessions, leaving ones included, in routing
// order (compareAgents).
func (r *registry) sessions() []*agentSession {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*agentSession, 0, len(r.agents)+len(r.leaving))
	for _, a := range r.agents {
		out = append(out, a)
	}
	for a := range r.leaving {
		out = append(out, a)
	}
	slices.SortFunc(out, compareAgents)
	return out
}

// reroute replaces the routes of a registered session (a repeated
// Advertise). Routes that changed got new dial addresses (bind), so pooled
// connections of the old ones are not reused for them.
func (r *registry) reroute(a *agentSession, entries []*routeEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := a.routes
	a.routes = entries
	if r.agents[a.key()] == a {
		r.applyLocked(tableChange{out: old, undial: old, in: entries, dial: entries})
	} else if _, ok := r.leaving[a]; ok {
		r.applyLocked(tableChange{undial: old, dial: entries})
	}
}

// key is the session's agent key.
func (a *agentSession) key() agentKey { return agentKey{a.credName, a.agentID} }

// setCredential gives a the credential that replaced its own of the same
// name on a reload. Callers hold node.admitMu.
func (a *agentSession) setCredential(c *credential) { a.auth.cred = c }

// currentRoutes returns a's routes under the registry lock.
func (a *agentSession) currentRoutes(mu *sync.Mutex) []*routeEntry {
	mu.Lock()
	defer mu.Unlock()
	return a.routes
}

// awaitHTTP waits up to d for an agent to serve host and returns its routes;
// nil when none came in time or ctx ended. With lb_try_duration set, a
// request that arrives while its agent reconnects waits for it, as it
// would wait for a healthy upstream with reverse_proxy.
func (r *registry) awaitHTTP(ctx context.Context, host string, d time.Duration) []*routeEntry {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		t := r.table.Load()
		if routes := t.lookupHTTP(host); len(routes) > 0 {
			return routes
		}
		select {
		case <-t.replaced:
		case <-timer.C:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// unmappedPrefix is p masked, and for an IPv4-mapped IPv6 prefix the IPv4
// prefix it covers: client addresses are compared unmapped, so a mapped
// prefix would match no one.
func unmappedPrefix(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p.Masked()
}
