package caddymodule

import (
	"hash/maphash"
	"iter"
	"maps"
	"slices"
)

// tableShards is how many shards each keyed index of the route table
// has. A registration copies only the shards its routes touch (copy on
// write): at 10,000 agents with two hosts each, a shard of the host index
// holds about 300 keys, so admitting one agent copies a few thousand map
// entries instead of every route of the node (rebuilding the whole table
// for each admission made connecting N agents cost O(N²)). More shards
// would copy less, but cost lookups more: Go scans a map of at most 8 keys
// linearly, comparing whole keys, and each shard is one more pointer to
// follow (BenchmarkLookupExact: 256 shards made a lookup among 1,000 hosts
// about three times slower than one map; 64 add about 5 ns).
const tableShards = 64

// shardSeed spreads string keys over the shards, unpredictably for agents.
var shardSeed = maphash.MakeSeed()

// shardedMap is an immutable map split into tableShards maps by key hash. A table shares the shards its change did not touch with the table
// it replaced; a shard, once in a published table, is never written again.
type shardedMap[K string | uint32, V any] struct {
	shards [tableShards]map[K]V // nil while empty
	n      int                  // keys in all shards
}

// hashKey spreads k over the shards.
func hashKey[K string | uint32](k K) uint64 {
	switch k := any(k).(type) {
	case string:
		return maphash.String(shardSeed, k)
	case uint32:
		return uint64(k)
	}
	return 0
}

// shard is the index of k's shard.
func (m *shardedMap[K, V]) shard(k K) int { return int(hashKey(k) & (tableShards - 1)) }

// get returns the value of k (the zero value when absent).
func (m *shardedMap[K, V]) get(k K) V { return m.shards[m.shard(k)][k] }

// len is the number of keys.
func (m *shardedMap[K, V]) len() int { return m.n }

// all yields every key and value, in no order.
func (m *shardedMap[K, V]) all() iter.Seq2[K, V] {
	return func(yield func(K, V) bool) {
		for _, s := range m.shards {
			for k, v := range s {
				if !yield(k, v) {
					return
				}
			}
		}
	}
}

// keys returns the keys, sorted.
func (m *shardedMap[K, V]) keys() []K {
	out := make([]K, 0, m.n)
	for k := range m.all() {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// shardWriter changes a copy of a shardedMap (the map of a table being
// built, a shallow copy of the published one): each shard is cloned
// before its first write, so the published table's stay as they are.
type shardWriter[K string | uint32, V any] struct {
	m      *shardedMap[K, V]
	cloned [tableShards]bool
}

// writable returns k's shard, cloned for writing.
func (w *shardWriter[K, V]) writable(k K) map[K]V {
	i := w.m.shard(k)
	if !w.cloned[i] {
		w.cloned[i] = true
		if s := w.m.shards[i]; s != nil {
			w.m.shards[i] = maps.Clone(s)
		} else {
			w.m.shards[i] = map[K]V{}
		}
	}
	return w.m.shards[i]
}

func (w *shardWriter[K, V]) set(k K, v V) {
	s := w.writable(k)
	if _, ok := s[k]; !ok {
		w.m.n++
	}
	s[k] = v
}

func (w *shardWriter[K, V]) delete(k K) {
	s := w.writable(k)
	if _, ok := s[k]; ok {
		w.m.n--
		delete(s, k)
	}
}

// pendingLists are the changes of one list index of a table being built:
// for each key touched, the entries it gains (the entries it loses are the
// change's out set).
type pendingLists[K string | uint32] map[K][]*routeEntry

// pend records that e enters (or, removing, leaves) the list of key k.
func pend[K string | uint32](b *tableBuilder, p pendingLists[K], k K, e *routeEntry) {
	if !b.lists {
		return
	}
	if b.removing {
		if _, ok := p[k]; !ok {
			p[k] = nil
		}
		return
	}
	p[k] = append(p[k], e)
}

// applyLists writes the pending changes into m: each key's list loses the
// entries in out and gains its new ones, in routing order (compareAgents;
// one agent's routes in advertise order, which the stable sort keeps).
// Only the touched keys' lists and shards are copied.
func applyLists[K string | uint32](m *shardedMap[K, []*routeEntry], p pendingLists[K], out map[*routeEntry]bool) {
	if len(p) == 0 {
		return
	}
	w := shardWriter[K, []*routeEntry]{m: m}
	for k, in := range p {
		old := m.get(k)
		list := make([]*routeEntry, 0, len(old)+len(in))
		for _, e := range old {
			if !out[e] {
				list = append(list, e)
			}
		}
		sorted := len(list) == 0 || len(in) == 0 || compareAgents(list[len(list)-1].agent, in[0].agent) <= 0
		list = append(list, in...)
		if !sorted {
			slices.SortStableFunc(list, func(a, b *routeEntry) int { return compareAgents(a.agent, b.agent) })
		}
		if len(list) == 0 {
			w.delete(k)
		} else {
			w.set(k, list)
		}
	}
}
