package caddymodule

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
)

// connGuard is the control listener as the gRPC server sees it. The
// control port is public on every real node, so what a connection that
// has not authenticated yet may cost is bounded here:
//
//   - Every accepted connection is pending until it proves itself: a gRPC
//     stream whose headers carry a valid credential (checked in the
//     transport's tap before any message is read, node.tapAuthenticate),
//     or a data lane or direct socket whose ticket or key checked out.
//   - A pending connection must send its first byte within
//     guardTiming.firstByte and prove itself within guardTiming.pending,
//     or it is closed.
//   - Pending connections are counted per node (max_pending_streams), per
//     address (max_pending_streams_per_address) and per network (/24 for
//     IPv4, /64 for IPv6: one host owns a whole /64, so counting full
//     addresses alone would bound nothing). When a new connection finds a
//     count full, the oldest pending connection of that count is evicted
//     to make room, not the new one refused: an agent's connection proves
//     itself within its first round trips, so unauthenticated connections
//     held open cannot keep it out.
//   - Connections are tracked as themselves, not by remote address (a unix
//     socket's peers all share one).
type connGuard struct {
	net.Listener
	n      *node
	log    *logthrottle.Throttle // evictions and expiries
	timing atomic.Pointer[guardTiming]

	mu       sync.Mutex // guards the pending list and its counts
	oldest   *guardedConn
	newest   *guardedConn
	count    int
	byAddr   map[netip.Addr]int
	byPrefix map[netip.Prefix]int
	bySite   map[netip.Prefix]int // /24 (IPv4), /48 (IPv6); the zero prefix: peers without an IP
}

// guardTiming holds the guard's deadlines (shorter in tests).
type guardTiming struct {
	// firstByte bounds how long a new connection may stay silent.
	firstByte time.Duration
	// pending bounds how long a connection may stay unauthenticated: a
	// TLS handshake (gRPC allows 10 s for it) and the first stream's
	// headers.
	pending time.Duration
	// preface bounds how long a data lane or direct socket may take to
	// send its preface after its first byte.
	preface time.Duration
}

var defaultGuardTiming = guardTiming{firstByte: 2 * time.Second, pending: 10 * time.Second, preface: 2500 * time.Millisecond}

// prefixPerAddress is how many pending connections one network (/24,
// /64) may hold, in multiples of the per-address limit.
const prefixPerAddress = 4

// newConnGuard returns the guard of n's control listener, which serve sets
// as its Listener before the first Accept.
func newConnGuard(n *node) *connGuard {
	g := &connGuard{
		n: n, log: logthrottle.New(10*time.Second, 5),
		byAddr: map[netip.Addr]int{}, byPrefix: map[netip.Prefix]int{}, bySite: map[netip.Prefix]int{},
	}
	t := defaultGuardTiming
	g.timing.Store(&t)
	return g
}

// Accept returns the next connection, counted as pending.
func (g *connGuard) Accept() (net.Conn, error) {
	c, err := g.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return g.admit(c), nil
}

// admit counts c as pending, evicting the oldest pending connections of
// every count that c would take past its limit.
func (g *connGuard) admit(c net.Conn) *guardedConn {
	gc := &guardedConn{Conn: c, g: g, accepted: time.Now(), state: connPending}
	gc.addr, gc.prefix, gc.site, gc.hasAddr = networkOf(c.RemoteAddr())
	opts := g.n.opts.Load()
	g.mu.Lock()
	evicted := g.makeRoomLocked(gc, opts)
	g.linkLocked(gc)
	gc.timer = time.AfterFunc(g.timing.Load().firstByte, gc.expire)
	g.mu.Unlock()
	for _, e := range evicted {
		e.Conn.Close()
	}
	if len(evicted) > 0 {
		g.logEvicted(evicted[0], len(evicted), opts)
	}
	return gc
}

// makeRoomLocked unlinks the pending connections to evict so that gc fits
// within the limits: first within its address, then its network, then the
// node, where the victim comes from the site (/24, /48) that holds the
// most pending connections: a flood that churns connections from a few
// sites to push an agent's out evicts its own. Callers hold g.mu and
// close what it returns.
func (g *connGuard) makeRoomLocked(gc *guardedConn, opts *nodeOptions) []*guardedConn {
	var out []*guardedConn
	evictWhile := func(full func() bool, same func(*guardedConn) bool) {
		for full() {
			victim := g.oldestLocked(same)
			if victim == nil {
				return
			}
			g.unlinkLocked(victim, connEvicted)
			out = append(out, victim)
		}
	}
	if gc.hasAddr && opts.maxPendingPerAddr > 0 {
		evictWhile(func() bool { return g.byAddr[gc.addr] >= opts.maxPendingPerAddr },
			func(o *guardedConn) bool { return o.hasAddr && o.addr == gc.addr })
		perPrefix := prefixPerAddress * opts.maxPendingPerAddr
		evictWhile(func() bool { return g.byPrefix[gc.prefix] >= perPrefix },
			func(o *guardedConn) bool { return o.hasAddr && o.prefix == gc.prefix })
	}
	if opts.maxPending > 0 {
		for g.count >= opts.maxPending {
			site := g.busiestSiteLocked()
			evictWhile(func() bool { return g.count >= opts.maxPending && g.busiestSiteLocked() == site },
				func(o *guardedConn) bool { return o.site == site })
		}
	}
	return out
}

// busiestSiteLocked returns the site holding the most pending connections
// (of several, the smallest prefix, so the choice does not depend on map
// order). Callers hold g.mu, with at least one connection pending.
func (g *connGuard) busiestSiteLocked() netip.Prefix {
	var best netip.Prefix
	most := 0
	for site, n := range g.bySite {
		if n > most || (n == most && site.Addr().Less(best.Addr())) {
			best, most = site, n
		}
	}
	return best
}

// oldestLocked returns the oldest pending connection for which match
// holds, preferring one that has not sent a byte yet.
func (g *connGuard) oldestLocked(match func(*guardedConn) bool) *guardedConn {
	var first *guardedConn
	for c := g.oldest; c != nil; c = c.next {
		if !match(c) {
			continue
		}
		if !c.spoke.Load() {
			return c
		}
		if first == nil {
			first = c
		}
	}
	return first
}

func (g *connGuard) linkLocked(c *guardedConn) {
	c.prev = g.newest
	if g.newest != nil {
		g.newest.next = c
	} else {
		g.oldest = c
	}
	g.newest = c
	g.count++
	g.bySite[c.site]++
	if c.hasAddr {
		g.byAddr[c.addr]++
		g.byPrefix[c.prefix]++
	}
}

// unlinkLocked takes pending c off the list and its counts, into state.
func (g *connGuard) unlinkLocked(c *guardedConn, state connState) {
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		g.oldest = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	} else {
		g.newest = c.prev
	}
	c.prev, c.next = nil, nil
	g.count--
	decrement(g.bySite, c.site)
	if c.hasAddr {
		decrement(g.byAddr, c.addr)
		decrement(g.byPrefix, c.prefix)
	}
	c.state = state
	c.timer.Stop()
}

func decrement[K comparable](m map[K]int, k K) {
	if m[k]--; m[k] <= 0 {
		delete(m, k)
	}
}

// pendingCount returns how many connections are pending.
func (g *connGuard) pendingCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.count
}

func (g *connGuard) logEvicted(c *guardedConn, n int, opts *nodeOptions) {
	if ok, suppressed := g.log.Allow(); ok {
		g.n.log().Warn("control connections evicted: too many connections have not authenticated; the oldest of the busiest address, network or site made room for a new one",
			zap.Stringer("remote", c.RemoteAddr()), zap.Int("evicted", n),
			zap.Int("max_pending_streams", opts.maxPending), zap.Int("max_pending_streams_per_address", opts.maxPendingPerAddr),
			zap.Int("suppressed_since_last", suppressed))
	}
}

// networkOf returns the address of an IP peer, the network counted with
// it (/24 for IPv4, /64 for IPv6: what one host may own) and its site (/24,
// /48: what one customer is routed); ok is false for other peers (unix
// sockets), whose site is the zero prefix.
func networkOf(a net.Addr) (addr netip.Addr, prefix, site netip.Prefix, ok bool) {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return netip.Addr{}, netip.Prefix{}, netip.Prefix{}, false
	}
	addr = ap.Addr().Unmap().WithZone("")
	netBits, siteBits := 64, 48
	if addr.Is4() {
		netBits, siteBits = 24, 24
	}
	prefix, _ = addr.Prefix(netBits)
	site, _ = addr.Prefix(siteBits)
	return addr, prefix, site, true
}

// connState is where an accepted control connection is in its life.
type connState uint8

const (
	connPending connState = iota // counted; closed if it does not authenticate in time
	connProven                   // authenticated: a gRPC stream, a lane, a direct socket
	connEvicted                  // closed to make room for a newer pending connection
	connExpired                  // closed: silent, or unauthenticated, for too long
	connClosed                   // closed by its owner while pending
)

// guardedConn is an accepted control connection.
type guardedConn struct {
	net.Conn
	g        *connGuard
	accepted time.Time
	addr     netip.Addr
	prefix   netip.Prefix
	site     netip.Prefix
	hasAddr  bool // addr and prefix are set (an IP peer)

	// spoke is set once the peer sent its first byte.
	spoke atomic.Bool
	// authFailures counts the streams refused for their credential.
	authFailures atomic.Int32
	// direct: the connection left gRPC as a direct socket, whose deadlines
	// are its virtual connection's: gRPC's SetDeadline, which clears its
	// handshake deadline after the handshake returned, must not clear
	// them.
	direct atomic.Bool

	// Guarded by g.mu.
	state      connState
	prev, next *guardedConn
	timer      *time.Timer
}

// Read implements net.Conn; the first byte moves the connection's deadline
// from the first-byte one to the authentication one.
func (c *guardedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 && !c.spoke.Load() {
		c.spoke.Store(true)
		c.rearm()
	}
	return n, err
}

// rearm sets the timer of a pending connection to its current deadline.
func (c *guardedConn) rearm() {
	c.g.mu.Lock()
	defer c.g.mu.Unlock()
	if c.state == connPending {
		c.timer.Reset(time.Until(c.deadline()))
	}
}

// deadline is when a pending connection expires.
func (c *guardedConn) deadline() time.Time {
	t := c.g.timing.Load()
	if c.spoke.Load() {
		return c.accepted.Add(t.pending)
	}
	return c.accepted.Add(t.firstByte)
}

// expire closes c if it is still pending past its deadline (the timer may
// fire just as its first byte moved the deadline).
func (c *guardedConn) expire() {
	g := c.g
	g.mu.Lock()
	if c.state != connPending {
		g.mu.Unlock()
		return
	}
	if left := time.Until(c.deadline()); left > 0 {
		c.timer.Reset(left)
		g.mu.Unlock()
		return
	}
	g.unlinkLocked(c, connExpired)
	g.mu.Unlock()
	c.Conn.Close()
	if ok, suppressed := g.log.Allow(); ok {
		what := "no credential within the time allowed"
		if !c.spoke.Load() {
			what = "no byte within the time allowed"
		}
		g.n.log().Info("control connection closed: "+what, zap.Stringer("remote", c.RemoteAddr()),
			zap.Duration("age", time.Since(c.accepted).Round(time.Millisecond)), zap.Int("suppressed_since_last", suppressed))
	}
}

// prove marks c authenticated: it no longer counts as pending and is not
// closed for its age. It reports false when c was evicted or expired
// meanwhile (and so is closed).
func (c *guardedConn) prove() bool {
	g := c.g
	g.mu.Lock()
	defer g.mu.Unlock()
	switch c.state {
	case connPending:
		g.unlinkLocked(c, connProven)
		return true
	case connProven:
		return true
	}
	return false
}

// closeIfPending closes c if it has not authenticated, and reports whether
// it did.
func (c *guardedConn) closeIfPending() bool {
	g := c.g
	g.mu.Lock()
	if c.state != connPending {
		g.mu.Unlock()
		return false
	}
	g.unlinkLocked(c, connClosed)
	g.mu.Unlock()
	c.Conn.Close()
	return true
}

// Close implements net.Conn.
func (c *guardedConn) Close() error {
	c.g.mu.Lock()
	if c.state == connPending {
		c.g.unlinkLocked(c, connClosed)
	}
	c.g.mu.Unlock()
	return c.Conn.Close()
}

// SetDeadline implements net.Conn (see direct).
func (c *guardedConn) SetDeadline(t time.Time) error {
	if c.direct.Load() {
		return nil
	}
	return c.Conn.SetDeadline(t)
}

// NetConn returns the socket (the stall watchdog reads its progress).
func (c *guardedConn) NetConn() net.Conn { return c.Conn }

// guardAuthInfo is a gRPC connection's AuthInfo with the guarded
// connection under it, so that a stream's credential check
// (node.tapAuthenticate) proves or penalises that connection itself.
type guardAuthInfo struct {
	credentials.AuthInfo
	conn *guardedConn
}

// Unwrap returns the wrapped AuthInfo (tunnelcore.ProgressOf looks
// through it).
func (a guardAuthInfo) Unwrap() credentials.AuthInfo { return a.AuthInfo }

// guardedConnOf returns the guarded connection a stream's context runs on,
// or nil.
func guardedConnOf(ctx context.Context) *guardedConn {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	if a, ok := p.AuthInfo.(guardAuthInfo); ok {
		return a.conn
	}
	return nil
}
