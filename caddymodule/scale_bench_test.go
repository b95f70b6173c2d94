package caddymodule

import (
	"fmt"
	"math/rand/v2"
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// registerMany registers sessions agents with the routes routes(i) each
// and builds the route table once, as register would after the last of
// them (register rebuilds the whole table for every session: see
// BenchmarkRegisterAt). Routes the pattern budget refuses are counted, not
// fatal.
func registerMany(tb testing.TB, r *registry, sessions int, routes func(i int) []*tunnelpb.Route) (refused int) {
	tb.Helper()
	for i := range sessions {
		a := &agentSession{agentID: fmt.Sprintf("agent%06d", i)}
		entries, rejected := validateRoutes(routes(i))
		if len(rejected) > 0 {
			tb.Fatalf("validation rejected %v", rejected)
		}
		entries, rejected = r.bind(a, entries, nil)
		refused += len(rejected)
		r.mu.Lock()
		a.routes = entries
		r.agents[a.key()] = a
		if i == sessions-1 || routes(i)[0].GetHostPattern() != "" {
			r.rebuildLocked() // the pattern budget of the next bind counts on the table
		}
		r.mu.Unlock()
	}
	return refused
}

// twoHosts is the Advertise of agent i at scale: two exact hosts.
func twoHosts(i int) []*tunnelpb.Route {
	return []*tunnelpb.Route{{Host: fmt.Sprintf("a%06d.scale.test", i)}, {Host: fmt.Sprintf("b%06d.scale.test", i)}}
}

// BenchmarkLookupExact: an HTTP lookup of an exact host with 1,000 to
// 100,000 exact hosts registered (two per agent, as bench/scale.sh runs),
// over 4,096 hosts in a random order so that the table is not all in
// cache, and of a host none serves. The target is <= 1 µs, independent of
// the count.
func BenchmarkLookupExact(b *testing.B) {
	for _, hosts := range []int{1_000, 10_000, 100_000} {
		r := newRegistry()
		registerMany(b, r, hosts/2, twoHosts)
		tab := r.table.Load()
		rnd := rand.New(rand.NewPCG(1, 2))
		keys := make([]string, 4096)
		for i := range keys {
			keys[i] = twoHosts(rnd.IntN(hosts / 2))[rnd.IntN(2)].GetHost()
		}
		b.Run(fmt.Sprintf("hosts=%d/hit", hosts), func(b *testing.B) {
			i := 0
			for b.Loop() {
				if len(tab.lookupHTTP(keys[i&4095])) != 1 {
					b.Fatal("a registered host was not found")
				}
				i++
			}
		})
		b.Run(fmt.Sprintf("hosts=%d/miss", hosts), func(b *testing.B) {
			for b.Loop() {
				if len(tab.lookupHTTP("nobody.scale.test")) != 0 {
					b.Fatal("an unknown host was found")
				}
			}
		})
	}
}

// BenchmarkLookup1kPatterns: an HTTP lookup with 1,000 pattern routes,
// one per agent. The node's pattern budget bounds what a lookup may cost,
// so 1,000 routes fit only when they share their patterns: shared is
// 1,000 routes over 8 distinct patterns, a host matching one of them (125
// routes) on a cache miss and from the cache; distinct is 1,000 agents
// each with a pattern of its own, of which the budget admits what fits
// (reported as admitted), a host that matches none, on a cache miss.
func BenchmarkLookup1kPatterns(b *testing.B) {
	const routes, distinct = 1000, 8
	r := newRegistry()
	if refused := registerMany(b, r, routes, func(i int) []*tunnelpb.Route {
		return []*tunnelpb.Route{{Name: fmt.Sprintf("w%d", i), HostPattern: fmt.Sprintf(`[a-z0-9-]+\.p%d\.scale\.test`, i%distinct)}}
	}); refused > 0 {
		b.Fatalf("the pattern budget refused %d of %d shared pattern routes", refused, routes)
	}
	tab := r.table.Load()
	host := "app-42.p3.scale.test"
	b.Run("shared/miss", func(b *testing.B) {
		for b.Loop() {
			tab.patterns.cache.slot(host).Store(nil)
			if len(tab.lookupHTTP(host)) != routes/distinct {
				b.Fatal("wrong routes")
			}
		}
	})
	b.Run("shared/cached", func(b *testing.B) {
		for b.Loop() {
			tab.lookupHTTP(host)
		}
	})

	r = newRegistry()
	refused := registerMany(b, r, routes, func(i int) []*tunnelpb.Route {
		return []*tunnelpb.Route{{Name: fmt.Sprintf("d%d", i), HostPattern: fmt.Sprintf(`[a-z0-9-]+\.d%d\.scale\.test`, i)}}
	})
	tab = r.table.Load()
	none := "app-42.none.scale.test"
	b.Run("distinct/miss", func(b *testing.B) {
		for b.Loop() {
			tab.patterns.cache.slot(none).Store(nil)
			tab.lookupHTTP(none)
		}
		b.ReportMetric(float64(routes-refused), "admitted")
	})
}

// BenchmarkRegisterAt: one more session of two hosts registered (and
// taken out again) with sessions of two hosts each already there: what
// one admission costs under admitMu as the table grows.
func BenchmarkRegisterAt(b *testing.B) {
	for _, sessions := range []int{100, 1_000, 10_000} {
		b.Run(fmt.Sprintf("sessions=%d", sessions), func(b *testing.B) {
			r := newRegistry()
			registerMany(b, r, sessions, twoHosts)
			extra := twoHosts(sessions)
			for b.Loop() {
				a := register(b, r, "extra", extra...)
				r.unregister(a)
			}
		})
	}
}
