package caddymodule

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TCPTarget selects the route of a raw TCP connection, in this order: an
// explicit route name, a TLS server name, the port the client connected to.
type TCPTarget struct {
	Route      string
	ServerName string
	LocalPort  uint32
}

// ErrNoRoute is returned when no agent serves a TCP connection.
var ErrNoRoute = errors.New("sluice: no agent serves this connection")

// ErrForbidden is returned when the route's allowed_cidrs exclude the
// client (the connection was closed at once).
var ErrForbidden = errors.New("sluice: client address not allowed on this route")

// ErrLimit is returned when a connection limit refused a TCP connection
// (it was closed at once).
var ErrLimit = errors.New("sluice: connection limit reached")

// RelayTCP relays client verbatim to the agent route target selects, until
// both directions end. client may have bytes already read by matchers: it
// must replay them (a *layer4.Connection does).
func (a *App) RelayTCP(client net.Conn, target TCPTarget) error {
	t := a.node.reg.table.Load()
	var routes []*routeEntry
	switch {
	case target.Route != "":
		routes = t.lookupName(target.Route)
	case target.ServerName != "":
		routes = t.lookupSNI(target.ServerName)
	default:
		if e := a.node.ports.owner(target.LocalPort); e != nil {
			return a.node.relayTCP(client, e, target.ServerName)
		}
		routes = t.byPort[target.LocalPort]
	}
	if len(routes) == 0 {
		return ErrNoRoute
	}
	return a.node.relayTCP(client, routes[0], target.ServerName)
}

// relayTCP opens a virtual connection for route e on its session and
// relays client through it, closing both when done or when the route's idle
// timeout passes with no byte either way.
func (n *node) relayTCP(client net.Conn, e *routeEntry, serverName string) error {
	if !e.allows(client.RemoteAddr().String()) {
		n.refuseTCP(client, "allowed_cidrs")
		return ErrForbidden
	}
	release, ok := n.clients.acquire(client.RemoteAddr().String(), n.opts.Load().maxConnsPerAddr)
	if !ok {
		n.refuseTCP(client, "max_connections_per_address")
		return ErrLimit
	}
	defer release()
	info := tunnelcore.ConnectInfo{
		RouteKey:   routeName(e.route),
		RemoteAddr: client.RemoteAddr().String(),
		LocalAddr:  client.LocalAddr().String(),
		ServerName: serverName,
	}
	up, err := e.agent.sess.Open(info)
	if errors.Is(err, tunnelcore.ErrConnLimit) {
		n.connLimitReached()
		n.refuseTCP(client, "max_connections")
		return ErrLimit
	}
	if err != nil {
		client.Close()
		return err
	}
	idle := time.Duration(e.route.GetVerbatimIdleTimeoutMs()) * time.Millisecond
	if idle == 0 {
		idle = n.opts.Load().verbatimIdleTimeout
	}
	if idle <= 0 {
		res := tunnelcore.Relay(client, up)
		return res.Err
	}
	w := newIdleWatch(idle)
	a, b := w.wrap(client), w.wrap(up)
	stop := w.start(func() {
		n.log().Debug("closing idle TCP relay", zap.String("route", info.RouteKey), zap.Duration("idle", idle))
		client.Close()
		up.Close()
	})
	defer stop()
	res := tunnelcore.Relay(a, b)
	return res.Err
}

// idleWatch closes a relay that moved no byte either way for a while.
type idleWatch struct {
	timeout time.Duration
	last    atomic.Int64 // unix nanos of the last byte
}

func newIdleWatch(d time.Duration) *idleWatch {
	w := &idleWatch{timeout: d}
	w.touch()
	return w
}

func (w *idleWatch) touch() { w.last.Store(time.Now().UnixNano()) }

// start checks for idleness until the returned stop is called.
func (w *idleWatch) start(onIdle func()) (stop func()) {
	done := make(chan struct{})
	var once sync.Once
	go func() {
		tick := time.NewTicker(max(w.timeout/4, 10*time.Millisecond))
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if time.Since(time.Unix(0, w.last.Load())) >= w.timeout {
					onIdle()
					return
				}
			}
		}
	}()
	return func() { once.Do(func() { close(done) }) }
}

func (w *idleWatch) wrap(c net.Conn) net.Conn { return &idleConn{Conn: c, w: w} }

// idleConn records activity on each read and write. It keeps CloseWrite so
// the relay can still half-close.
type idleConn struct {
	net.Conn
	w *idleWatch
}

func (c *idleConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.w.touch()
	}
	return n, err
}

func (c *idleConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.w.touch()
	}
	return n, err
}

// CloseWrite half-closes the wrapped connection. One that cannot half-close
// reports it, so the relay ends both directions (as it does unwrapped)
// rather than go on copying into a connection closed under it.
func (c *idleConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("connection cannot half-close")
}
