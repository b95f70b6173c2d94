package caddymodule

import (
	"hash/maphash"
	"strings"
	"sync/atomic"
)

// lookupCacheSize is the number of host names a route table remembers the
// pattern routes of (per kind of lookup): enough for the hosts a node
// serves, and a fixed size, so random Host headers evict each other
// instead of growing it. A power of two.
const lookupCacheSize = 4096

// maxCachedRoutes: a decision naming more routes is not remembered, so the
// cache holds at most lookupCacheSize*maxCachedRoutes pointers whatever
// the patterns; such a lookup runs the patterns again, within the budget.
const maxCachedRoutes = 32

// lookupCache remembers host -> matching pattern routes for one route
// table: a direct-mapped array, one host per slot, replaced on collision.
// A table is immutable, so its decisions stay true for its life, and a
// registration change, which builds a new table, starts with an empty
// cache. Safe for concurrent use without locks.
type lookupCache struct {
	seed  maphash.Seed // per table: an attacker cannot aim hosts at a slot
	slots [lookupCacheSize]atomic.Pointer[cachedLookup]
}

type cachedLookup struct {
	host   string
	routes []*routeEntry
}

func newLookupCache() *lookupCache {
	return &lookupCache{seed: maphash.MakeSeed()}
}

func (c *lookupCache) slot(host string) *atomic.Pointer[cachedLookup] {
	return &c.slots[maphash.String(c.seed, host)&(lookupCacheSize-1)]
}

// get returns the routes remembered for host.
func (c *lookupCache) get(host string) ([]*routeEntry, bool) {
	if e := c.slot(host).Load(); e != nil && e.host == host {
		return e.routes, true
	}
	return nil, false
}

// put remembers routes for host. The host is copied: a routing key may be
// a slice of a larger request buffer.
func (c *lookupCache) put(host string, routes []*routeEntry) {
	if len(routes) > maxCachedRoutes {
		return
	}
	c.slot(host).Store(&cachedLookup{host: strings.Clone(host), routes: routes})
}
