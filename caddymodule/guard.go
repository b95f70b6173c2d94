package caddymodule

import (
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
)

// connGuard is the control listener as the gRPC server sees it. It bounds
// the connections that have not proven themselves yet: those that carried
// no Connect stream with the token and are no data lane. Without it, a
// client without the token could keep any number of connections open for
// good (each with gRPC's buffers and goroutines): gRPC's MaxConnectionIdle
// restarts whenever a stream ends, refused ones included. An unproven
// connection counts against max_pending_streams and
// max_pending_streams_per_address, as a stream waiting for its Advertise
// does, and is closed once it has been unproven for unprovenLifetime.
type connGuard struct {
	net.Listener
	n      *node
	total  counterLimiter
	byAddr *addrLimiter
	log    *logthrottle.Throttle
	// lifetime is unprovenLifetime (nanoseconds), shorter in tests.
	lifetime atomic.Int64

	mu       sync.Mutex
	unproven map[string]*guardedConn // by remote address
}

// unprovenLifetime bounds how long a connection may stay unproven: long
// enough for a slow TLS handshake (gRPC allows 10 s) and the Connect that
// follows it.
const unprovenLifetime = 30 * time.Second

func newConnGuard(ln net.Listener, n *node) *connGuard {
	g := &connGuard{
		Listener: ln, n: n, byAddr: newAddrLimiter(), log: logthrottle.New(10*time.Second, 5),
		unproven: map[string]*guardedConn{},
	}
	g.lifetime.Store(int64(unprovenLifetime))
	return g
}

// Accept returns the next connection within the bounds, closing those past
// them.
func (g *connGuard) Accept() (net.Conn, error) {
	for {
		c, err := g.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if gc := g.admit(c); gc != nil {
			return gc, nil
		}
	}
}

// admit counts c as unproven, or closes it when it is past a bound.
func (g *connGuard) admit(c net.Conn) *guardedConn {
	opts := g.n.opts.Load()
	remote := c.RemoteAddr().String()
	rel, ok := g.total.acquire(opts.maxPending)
	if !ok {
		g.refuse(c, "max_pending_streams", opts.maxPending)
		return nil
	}
	relAddr, ok := g.byAddr.acquire(remote, opts.maxPendingPerAddr)
	if !ok {
		rel()
		g.refuse(c, "max_pending_streams_per_address", opts.maxPendingPerAddr)
		return nil
	}
	gc := &guardedConn{Conn: c, g: g, key: remote, release: func() { relAddr(); rel() }}
	g.mu.Lock()
	g.unproven[remote] = gc
	gc.timer = time.AfterFunc(time.Duration(g.lifetime.Load()), gc.expire) // under mu: forget reads it
	g.mu.Unlock()
	return gc
}

func (g *connGuard) refuse(c net.Conn, limit string, n int) {
	c.Close()
	if ok, suppressed := g.log.Allow(); ok {
		g.n.log().Warn("control connection refused: too many connections have not presented the token",
			zap.String("remote", c.RemoteAddr().String()), zap.String("limit", limit), zap.Int("value", n),
			zap.Int("suppressed_since_last", suppressed))
	}
}

// prove marks the connection from remote as proven (it carried a Connect
// with the token): it no longer counts, and is not closed for its age.
func (g *connGuard) prove(remote string) {
	g.mu.Lock()
	gc := g.unproven[remote]
	g.mu.Unlock()
	if gc != nil {
		gc.prove()
	}
}

// guardedConn is an accepted control connection.
type guardedConn struct {
	net.Conn
	g       *connGuard
	key     string
	release func()
	timer   *time.Timer
	// direct: the connection left gRPC as a direct socket, whose deadlines
	// are its virtual connection's: gRPC's SetDeadline, which clears its
	// handshake deadline after the handshake returned, must not clear
	// them.
	direct atomic.Bool
}

// SetDeadline implements net.Conn (see direct).
func (c *guardedConn) SetDeadline(t time.Time) error {
	if c.direct.Load() {
		return nil
	}
	return c.Conn.SetDeadline(t)
}

// forget takes c off the unproven connections; it reports whether c was
// one of them.
func (c *guardedConn) forget() bool {
	g := c.g
	g.mu.Lock()
	mine := g.unproven[c.key] == c
	if mine {
		delete(g.unproven, c.key)
	}
	g.mu.Unlock()
	if mine {
		c.timer.Stop()
		c.release()
	}
	return mine
}

// prove marks c as proven: a data lane (its ticket is checked next, within
// gRPC's handshake timeout), or the carrier of an authorized stream.
func (c *guardedConn) prove() { c.forget() }

// expire closes c if it is still unproven.
func (c *guardedConn) expire() {
	if c.forget() {
		c.Conn.Close()
		if ok, suppressed := c.g.log.Allow(); ok {
			c.g.n.log().Info("control connection closed: no Connect with the token within the time allowed",
				zap.String("remote", c.key), zap.Duration("allowed", time.Duration(c.g.lifetime.Load())), zap.Int("suppressed_since_last", suppressed))
		}
	}
}

// Close implements net.Conn.
func (c *guardedConn) Close() error {
	c.forget()
	return c.Conn.Close()
}

// NetConn returns the socket (the stall watchdog reads its progress).
func (c *guardedConn) NetConn() net.Conn { return c.Conn }
