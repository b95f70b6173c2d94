package caddymodule

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"

	"github.com/sluice-tunnel/sluice/internal/route"
)

// LB policies of the layer4 `sluice` handler (lb_policy): how a TCP
// connection or a UDP flow chooses among the agents serving its route,
// the counterpart of reverse_proxy's lb_policy for HTTP. The route's
// agents are listed by agent id (routing order), so `first` decides the
// same on every node of a cluster; the others spread the load.
const (
	// LBFirst takes the agent with the smallest id (the default).
	LBFirst = "first"
	// LBRoundRobin takes the route's agents in turn.
	LBRoundRobin = "round_robin"
	// LBRandom takes one of them at random.
	LBRandom = "random"
	// LBLeastConn takes the agent with the fewest connections open on the
	// route (relays and flows of this node), the first of them on a tie.
	LBLeastConn = "least_conn"
)

// ValidLBPolicy reports an error naming the valid values if name is not
// one ("" stands for first).
func ValidLBPolicy(name string) error {
	switch name {
	case "", LBFirst, LBRoundRobin, LBRandom, LBLeastConn:
		return nil
	}
	// In the order the error lists them.
	names := []string{LBFirst, LBRoundRobin, LBRandom, LBLeastConn}
	return fmt.Errorf("unknown policy %q (want one of %s)", name, strings.Join(names, ", "))
}

// LBPolicy chooses one of the agents serving a layer4 route. One belongs
// to each layer4 `sluice` handler: its round-robin position is the
// handler's own, as each reverse_proxy handler has its own, and starts
// over when a config load provisions the handler anew. A nil *LBPolicy is
// first. It is safe for concurrent use: choosing takes no lock.
type LBPolicy struct {
	name string
	next atomic.Uint64 // round_robin: the turn of the next choice
}

// NewLBPolicy returns the policy name stands for ("" is first), or an
// error naming the valid values.
func NewLBPolicy(name string) (*LBPolicy, error) {
	if err := ValidLBPolicy(name); err != nil {
		return nil, err
	}
	if name == "" {
		name = LBFirst
	}
	return &LBPolicy{name: name}, nil
}

// Name is the policy's lb_policy value.
func (p *LBPolicy) Name() string {
	if p == nil {
		return LBFirst
	}
	return p.name
}

// spreads reports whether the policy may choose another route than the
// first: only then do the routes of a server name include every agent's
// route of the same pattern (sniPeers).
func (p *LBPolicy) spreads() bool { return p != nil && p.name != LBFirst }

// pick chooses among routes, listed in routing order; nil when there is
// none. One route is taken as is, whatever the policy, so a route one
// agent serves behaves as it always did.
func (p *LBPolicy) pick(routes []*routeEntry) *routeEntry {
	switch {
	case len(routes) == 0:
		return nil
	case len(routes) == 1 || !p.spreads():
		return routes[0]
	}
	switch p.name {
	case LBRoundRobin:
		return routes[(p.next.Add(1)-1)%uint64(len(routes))]
	case LBRandom:
		return routes[rand.IntN(len(routes))]
	case LBLeastConn:
		best, fewest := routes[0], routes[0].conns().Load()
		for _, e := range routes[1:] {
			if n := e.conns().Load(); n < fewest {
				best, fewest = e, n
			}
		}
		return best
	}
	return routes[0]
}

// sniPeers returns the routes a spreading policy chooses among for the
// TLS server name name when lookupSNI found routes: those it found, or,
// when that is the first matching pattern route alone (the table's SNI
// pattern lookup stops at the first match, which is all `first` needs),
// every agent's route of that same pattern whose scope covers name, in
// routing order. The table indexes pattern routes by pattern
// (bySource), so this costs a map lookup, not another pattern walk.
func sniPeers(t *routeTable, name string, routes []*routeEntry) []*routeEntry {
	if len(routes) != 1 {
		return routes
	}
	e := routes[0]
	if e.kind != route.TCPHostPattern && e.kind != route.PassthroughPattern {
		return routes
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".") // as lookupSNI matched it
	peers := routesWhere(t.bySource[patternKey(e)], func(p *routeEntry) bool {
		return p.kind == e.kind && p.inScope(name)
	})
	if len(peers) == 0 {
		// Not reached while the table indexes e both ways, as it
		// does: e matched name, so it is among them. Never worse
		// than first, should that change.
		return routes
	}
	return peers
}
