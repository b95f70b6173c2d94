package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"go.uber.org/zap"
)

// A cluster is several nodes that share nothing but Caddy's storage: every
// agent keeps a session with every node, so any node serves any host. The
// agent bootstraps with its server setting; the nodes then push the
// cluster's membership (MembershipUpdate, membership.go), or, with
// server_each_address, the server's DNS name is the membership
// (addresses.go). The cluster type below keeps the agent's links, one per
// node, as the membership says: it opens links for new members and leaves
// those no longer listed, as the agent leaves on shutdown.
//
// Links are keyed by node id. The server's link is keyed by the node it
// reached, and, once the membership gives that node a URL, dials that URL
// on its later reconnects: an agent bootstrapped through a load
// balancer's name keeps one session per node. A node keeps one session
// per agent id, and a second one displaces the first, so a link whose
// session reaches a node another link serves already stands by
// (link.standBy) instead of displacing that one's.

// maxLinks bounds the links the agent keeps for a membership or for the
// addresses of the server's name: it bounds the goroutines and memory the
// links take (see BenchmarkIdleLinkCost) and the values of the node label
// of the metrics. Links leaving their node come on top until they ended.
const maxLinks = 64

// linkEntry is a link and its place in the cluster.
type linkEntry struct {
	l *link
	// key is the link's node: the member's id for a link that dials a
	// member's URL, the address for a link to an address of the
	// server's name, else the node the link reached last ("" before).
	key string
	// nodeID is the node the link's last session reached.
	nodeID string
	// standbyFor is the node id another link serves, while this one
	// stands by. A link leaving its node (link.leaving) no longer counts.
	standbyFor string
}

// cluster keeps the agent's links.
type cluster struct {
	a *Agent
	// changed tells the manager (run) that a link ended or reached a node
	// (capacity 1: a pending signal covers the later changes).
	changed chan struct{}
	// box holds the MembershipUpdates the sessions received.
	box membershipBox

	mu      sync.Mutex
	entries []*linkEntry // in the order the links were opened
	noLink  string       // why there is no link yet (server_each_address)

	// The manager's own state, touched by run's goroutine alone.
	ctx      context.Context // run's: the links run under it
	wg       sync.WaitGroup  // the links' goroutines
	members  *membership     // the membership applied last; nil before one
	warned   map[string]bool // problems logged once
	addrs    []string        // server_each_address: the addresses resolved last
	resolveE string          // server_each_address: the resolve error logged last
	others   string          // server_each_address: the membership logged last
}

func newCluster(a *Agent) *cluster {
	return &cluster{
		a:       a,
		changed: make(chan struct{}, 1),
		box:     membershipBox{ready: make(chan struct{}, 1), offers: map[*link]membershipOffer{}},
		warned:  map[string]bool{},
	}
}

// run keeps the links until ctx ends or the agent leaves, then waits for
// every link to end (each leaves its node then, as Leave says).
func (c *cluster) run(ctx context.Context) {
	c.ctx = ctx
	defer c.wg.Wait()
	if c.a.leavingNow() {
		return
	}
	if c.a.cfg.ServerEachAddress {
		c.runAddresses(ctx)
		return
	}
	c.mu.Lock()
	c.openLocked(serverTarget(c.a.cfg), originServer, "")
	c.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.a.leaveReq.Done():
			return
		case <-c.box.ready:
			for _, o := range c.box.take() {
				c.apply(o)
			}
		case <-c.changed:
			c.reconcile()
			c.wakeStandbys()
		}
	}
}

// signal tells the manager something changed; it never blocks.
func (c *cluster) signal() {
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// openLocked opens a link to t and starts it. c.mu is held.
func (c *cluster) openLocked(t *linkTarget, origin linkOrigin, key string) {
	l := newLink(c.a, origin, t)
	c.entries = append(c.entries, &linkEntry{l: l, key: key})
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		l.run(c.ctx)
	}()
}

// retireLocked makes e's link leave its node gracefully; the link is no
// longer counted, and ends once its session did. c.mu is held.
func (c *cluster) retireLocked(e *linkEntry, why string) {
	e.l.log().Info("closing the session with this node", zap.String("reason", why), zap.String("server", e.l.target.Load().url))
	e.l.leaveAlone(why)
	c.signal() // a link standing by for its node may take over
}

// activeLocked counts the links not leaving. c.mu is held.
func (c *cluster) activeLocked() int {
	n := 0
	for _, e := range c.entries {
		if !e.l.leaving() {
			n++
		}
	}
	return n
}

// keyedLocked returns the link keyed key that is not leaving. c.mu is held.
func (c *cluster) keyedLocked(key string) *linkEntry {
	for _, e := range c.entries {
		if !e.l.leaving() && e.key == key {
			return e
		}
	}
	return nil
}

// entryLocked returns l's entry, nil once it ended. c.mu is held.
func (c *cluster) entryLocked(l *link) *linkEntry {
	for _, e := range c.entries {
		if e.l == l {
			return e
		}
	}
	return nil
}

// ended takes a link that ended out of the cluster.
func (c *cluster) ended(l *link) {
	c.mu.Lock()
	c.entries = slices.DeleteFunc(c.entries, func(e *linkEntry) bool { return e.l == l })
	c.mu.Unlock()
	c.signal()
}

// claim records that l's session, dialed to t, reached node id, and
// returns "" when l may serve it: else the URL of the link that serves
// that node already (a link not leaving, not standing by, that reached it
// or is keyed by it), and l stands by for it. The server's link, when it
// dialed the server setting, takes the node it reached as its key, and
// the server setting as its target again after a fallback
// (link.nextTarget).
func (c *cluster) claim(l *link, id string, t *linkTarget) (servedBy string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entryLocked(l)
	if e == nil {
		return ""
	}
	if o := c.servedByOtherLocked(e, id); o != nil {
		e.standbyFor = id
		return o.l.target.Load().url
	}
	e.nodeID, e.standbyFor = id, ""
	if l.origin == originServer && t.member == "" && id != "" {
		e.key = id
		// After a fallback that reached another node than the member the
		// link dialed, it dials the server setting until the membership
		// gives that node's URL; the URL of the node it reached stays.
		if cur := l.target.Load(); cur != t && cur.member != id {
			l.target.Store(t)
			l.log().Warn("reached the cluster again through the server setting", zap.String("server", t.url), zap.String("was", cur.url))
		}
	}
	c.signal()
	return ""
}

// servedByOtherLocked returns the link other than e that serves node id,
// or nil. c.mu is held.
func (c *cluster) servedByOtherLocked(e *linkEntry, id string) *linkEntry {
	if id == "" { // a node without an id: nothing to compare
		return nil
	}
	for _, o := range c.entries {
		if o != e && !o.l.leaving() && o.standbyFor == "" && (o.nodeID == id || o.key == id) {
			return o
		}
	}
	return nil
}

// mayResume reports whether l, standing by since its target was at, may
// try again: its target changed, or no other link serves its node now.
func (c *cluster) mayResume(l *link, at *linkTarget) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entryLocked(l)
	if e == nil || l.target.Load() != at || c.servedByOtherLocked(e, e.standbyFor) == nil {
		if e != nil {
			e.standbyFor = ""
		}
		return true
	}
	return false
}

// wakeStandbys wakes the links standing by, which check whether they may
// try again (mayResume).
func (c *cluster) wakeStandbys() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.entries {
		if e.standbyFor != "" {
			e.l.poke()
		}
	}
}

// links returns the links, in the order they were opened.
func (c *cluster) links() []*link {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*link, 0, len(c.entries))
	for _, e := range c.entries {
		out = append(out, e.l)
	}
	return out
}

// anyUp reports whether a link has a session.
func (c *cluster) anyUp() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.entries {
		if sessionUp(e.l.state()) {
			return true
		}
	}
	return false
}

// stateRank orders the states of links without a session, the most
// advanced highest: the agent's State is its most advanced link's.
func stateRank(s State) int {
	switch s {
	case StateConnecting:
		return 4
	case StateRetrying:
		return 3
	case StateStandby:
		return 2
	case StateIdle:
		return 1
	}
	return 0
}

// state is the agent's State while Run runs (see Agent.State).
func (c *cluster) state() State {
	c.mu.Lock()
	defer c.mu.Unlock()
	best, rank := StateConnecting, -1 // no link yet: connecting
	for _, e := range c.entries {
		s := e.l.state()
		if sessionUp(s) {
			return StateConnected
		}
		if r := stateRank(s); r > rank {
			best, rank = s, r
		}
	}
	return best
}

// noLinkReason says why the agent has no link (Ready).
func (c *cluster) noLinkReason() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.noLink != "":
		return c.noLink
	case c.a.cfg.ServerEachAddress:
		return "no address of the server resolved yet"
	}
	return fmt.Sprintf("no session with %s (%s)", c.a.cfg.Server, StateConnecting) // the link is about to open
}

// warnOnce logs a problem of the membership or of the resolved addresses
// once: the nodes repeat their membership, and the agent would repeat the
// warning with every update. The set is bounded: it starts again when it
// grew past a few memberships' worth. Manager only.
func (c *cluster) warnOnce(msg string, fields ...zap.Field) {
	var key strings.Builder
	key.WriteString(msg)
	for _, f := range fields {
		fmt.Fprintf(&key, " %s=%s/%d/%v", f.Key, f.String, f.Integer, f.Interface)
	}
	if c.warned[key.String()] {
		return
	}
	if len(c.warned) >= 4*maxLinks {
		clear(c.warned)
	}
	c.warned[key.String()] = true
	c.a.log.Warn(msg, fields...)
}
