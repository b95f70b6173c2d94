package caddymodule

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestIncrementalTableMatchesRebuild: after any sequence of registrations,
// replacements, reroutes, withdrawals and ends, the table the changes
// built one at a time (nextTable) routes as one built from scratch
// (buildTable): the same lists, in the same order, for every key, and the
// same routes by dial address.
func TestIncrementalTableMatchesRebuild(t *testing.T) {
	rnd := rand.New(rand.NewPCG(7, 11))
	r := newRegistry()
	var live []*agentSession
	routesOf := func() []*tunnelpb.Route {
		var rts []*tunnelpb.Route
		for range 1 + rnd.IntN(3) {
			switch k := rnd.IntN(6); k {
			case 0:
				rts = append(rts, &tunnelpb.Route{Host: fmt.Sprintf("h%d.test", rnd.IntN(8))})
			case 1:
				rts = append(rts, &tunnelpb.Route{Name: fmt.Sprintf("svc%d", rnd.IntN(4)), Target: "tcp://127.0.0.1:9"})
			case 2:
				rts = append(rts, &tunnelpb.Route{HostPattern: fmt.Sprintf("*.p%d.test", rnd.IntN(3))})
			case 3:
				rts = append(rts, &tunnelpb.Route{ListenPort: uint32(16000 + rnd.IntN(3)), Target: "tcp://127.0.0.1:9"})
			case 4:
				rts = append(rts, &tunnelpb.Route{})
			default:
				rts = append(rts, &tunnelpb.Route{Host: fmt.Sprintf("t%d.test", rnd.IntN(4)), Target: "tcp://127.0.0.1:9"})
			}
		}
		return rts
	}
	for step := range 400 {
		switch op := rnd.IntN(5); {
		case op <= 1 || len(live) == 0:
			a := &agentSession{agentID: fmt.Sprintf("agent-%d", rnd.IntN(12))}
			entries, _ := validateRoutes(routesOf()) // duplicates are rejected
			entries, _ = r.bind(a, entries, nil)
			r.register(a, entries)
			live = append(live, a)
		case op == 2:
			a := live[rnd.IntN(len(live))]
			entries, _ := validateRoutes(routesOf())
			entries, _ = r.bind(a, entries, a.currentRoutes(&r.mu))
			r.reroute(a, entries)
		case op == 3:
			r.withdraw(live[rnd.IntN(len(live))])
		default:
			i := rnd.IntN(len(live))
			r.unregister(live[i])
			live = slices.Delete(live, i, i+1)
		}
		r.mu.Lock()
		leaving := make([]*agentSession, 0, len(r.leaving))
		for a := range r.leaving {
			leaving = append(leaving, a)
		}
		want := buildTable(r.sortedAgentsLocked(), leaving)
		r.mu.Unlock()
		if err := sameTable(r.table.Load(), want); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
	}
}

// sameTable compares what two tables route.
func sameTable(got, want *routeTable) error {
	for _, idx := range []struct {
		name      string
		got, want *shardedMap[string, []*routeEntry]
	}{{"exact", &got.exact, &want.exact}, {"sniExact", &got.sniExact, &want.sniExact}, {"byName", &got.byName, &want.byName}} {
		if err := sameLists(idx.name, idx.got, idx.want); err != nil {
			return err
		}
	}
	if err := sameLists("byPort", &got.byPort, &want.byPort); err != nil {
		return err
	}
	if got.byDial.len() != want.byDial.len() {
		return fmt.Errorf("byDial: %d keys, want %d", got.byDial.len(), want.byDial.len())
	}
	for k, e := range want.byDial.all() {
		if got.byDial.get(k) != e {
			return fmt.Errorf("byDial[%s] differs", k)
		}
	}
	if !slices.Equal(got.catchAll, want.catchAll) || !slices.Equal(got.patterns.entries, want.patterns.entries) ||
		!slices.Equal(got.sniPatterns.entries, want.sniPatterns.entries) || got.load.total != want.load.total {
		return fmt.Errorf("the pattern indexes, catch-all list or load differ")
	}
	return nil
}

func sameLists[K string | uint32](name string, got, want *shardedMap[K, []*routeEntry]) error {
	if got.len() != want.len() {
		return fmt.Errorf("%s: %d keys, want %d", name, got.len(), want.len())
	}
	for k, es := range want.all() {
		if !slices.Equal(got.get(k), es) {
			return fmt.Errorf("%s[%v]: %d routes, want %d (or another order)", name, k, len(got.get(k)), len(es))
		}
	}
	return nil
}
