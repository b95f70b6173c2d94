package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The agent as a Go library: Listen starts an agent whose routes are served
// by the calling program instead of dialed upstreams. The node's virtual
// connections for those routes come out of Listener.Accept as net.Conns, so
// a program hands the Listener to its own http.Server (or any server loop)
// and is reachable through the tunnel without a local port.
//
// The seam is Upstream.local: the connector, which dials the target of
// every other route, hands a local route's connections to its Listener
// (handOver) and stays out of their lifetime; the slot a connection takes
// of max_connections is held until the program closes it.

// listenBacklog bounds the connections waiting for Accept, as a TCP
// listen backlog does: the node's connections beyond it are refused
// (RESOURCE_EXHAUSTED, a 502 for HTTP) rather than queued without bound
// in front of a program that stopped accepting.
const listenBacklog = 512

// Errors of a Listener's connections that Accept never returned.
var (
	errListenerClosed = errors.New("listener closed: the route is being withdrawn")
	errBacklogFull    = fmt.Errorf("listener backlog of %d connections full: the program does not Accept", listenBacklog)
)

// WithLogger makes the agent log to l (nil: keeps New's logger). It is
// how Listen, which has no logger argument, is given one.
func WithLogger(l *zap.Logger) Option {
	return func(a *Agent) {
		if l != nil {
			a.log = l
		}
	}
}

// Listen starts an agent for cfg that serves route in-process, and returns
// once a node accepted the route: the node's connections for it are
// delivered by the Listener's Accept instead of being dialed.
//
// route is an Upstream whose Target dials nothing: leave it empty for an
// HTTP route (the node speaks to the program as to an http:// target:
// HTTP/1.1, or h2c where the site's transport enables it, which
// ForceHTTP1 keeps off), or set tcp:// for a raw TCP route (listen_port,
// tls_passthrough, a named service). Every other field means what it
// means in the configuration file; proxy_protocol does not apply (the
// accepted connection's RemoteAddr is the client) and udp:// is not
// served by a Listener.
//
// cfg is the agent's configuration (server, token, limits...), which
// Listen copies and validates; the upstreams it lists, if any, are
// served alongside by dialing as Run serves them, and leave with the
// Listener. Options are New's (WithLogger, WithConnEnd...).
//
// ctx bounds the wait for the first node's AdvertiseAck only: when it
// ends first, or a node rejects the route (its host is served by an agent
// of another credential, its port is outside the node's range...), Listen
// stops the agent and returns an error saying why. The agent then keeps
// its sessions, reconnecting as Run does, until Close or Shutdown.
func Listen(ctx context.Context, cfg *Config, route Upstream, opts ...Option) (*Listener, error) {
	return ListenRoutes(ctx, cfg, []Upstream{route}, opts...)
}

// ListenRoutes is Listen for several routes served by one Listener and one
// agent: Accept delivers the connections of every route, and the accepted
// Conn's Route tells which (a program serving HTTP for several hosts
// reads the Host header instead).
func ListenRoutes(ctx context.Context, cfg *Config, routes []Upstream, opts ...Option) (*Listener, error) {
	if cfg == nil {
		return nil, errors.New("agent: listen: nil config")
	}
	if len(routes) == 0 {
		return nil, errors.New("agent: listen: no route")
	}
	l := &Listener{
		queue:  make(chan *Conn, listenBacklog),
		closed: make(chan struct{}),
		done:   make(chan struct{}),
	}
	// A copy: Validate normalises and fills it, and the Listener's routes
	// are added to it; the caller's Config stays as it was.
	c := *cfg
	c.Upstreams = slices.Clone(cfg.Upstreams)
	names := make([]string, 0, len(routes))
	for i, u := range routes {
		u.local = l
		u.origin = fmt.Sprintf("routes[%d]", i)
		c.Upstreams = append(c.Upstreams, u)
	}
	a, err := New(&c, nil, opts...)
	if err != nil {
		return nil, fmt.Errorf("agent: listen: %w", err)
	}
	for _, u := range c.Upstreams[len(cfg.Upstreams):] {
		names = append(names, u.Name)
	}
	l.a, l.addr = a, ListenAddr{Routes: names}
	runCtx, stop := context.WithCancel(context.Background())
	l.stop = stop
	go l.run(runCtx)
	if err := l.awaitAccepted(ctx); err != nil {
		l.closeQueue()
		stop()
		<-l.done
		return nil, err
	}
	return l, nil
}

// run runs the agent until it stops, then closes the queue: nothing will
// deliver a connection any more, so Accept returns net.ErrClosed instead
// of waiting for good, and a connection still in the backlog is refused
// (it holds a max_connections slot). The agent may stop without Close: a
// program that called Agent().Leave, say.
func (l *Listener) run(ctx context.Context) {
	defer close(l.done)
	l.runErr = l.a.Run(ctx)
	l.closeQueue()
}

// awaitAccepted waits until a node acknowledged the Listener's routes, and
// fails when it rejected one of them or ctx ended first.
func (l *Listener) awaitAccepted(ctx context.Context) error {
	select {
	case <-l.a.Connected():
	case <-l.done:
		return fmt.Errorf("agent: listen: the agent stopped: %w", l.runErr)
	case <-ctx.Done():
		_, why := l.a.Ready()
		return fmt.Errorf("agent: listen: no node acknowledged the routes (%s): %w", why, context.Cause(ctx))
	}
	var rejected []string
	for _, r := range l.a.Status().Routes {
		if r.Ack == AckRejected && slices.Contains(l.addr.Routes, r.Name) {
			rejected = append(rejected, fmt.Sprintf("%s (%s)", r.Name, r.Reason))
		}
	}
	if len(rejected) > 0 {
		return fmt.Errorf("agent: listen: the node rejected route %s", strings.Join(rejected, ", "))
	}
	return nil
}

// Listener is a net.Listener whose connections are the virtual
// connections a sluice node opens for its routes (see Listen). Closing it
// withdraws the routes and ends the agent once the connections accepted
// are closed.
type Listener struct {
	a    *Agent
	addr ListenAddr

	// queue holds the connections delivered and not yet accepted; mu
	// orders deliveries against Close, which drains it, so that no
	// connection is left in it after Close.
	mu        sync.Mutex
	queue     chan *Conn
	closed    chan struct{}
	closeOnce sync.Once

	stop   context.CancelFunc // ends Run at once
	done   chan struct{}      // closed when Run returned
	runErr error              // Run's result, once done
}

// Accept waits for and returns the next connection a node opened for one
// of the Listener's routes, an *agent.Conn. After Close, or once the agent
// stopped, it returns net.ErrClosed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case <-l.closed:
		return nil, net.ErrClosed
	default:
	}
	select {
	case c := <-l.queue:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

// Close withdraws the routes and returns at once: the agent sends every
// node Drain, so that nodes route nothing new to it (once the Drain
// reached them, an HTTP request for the host is answered 503 unless
// another agent serves it; the connections a node routed just before are
// refused), and the agent ends its sessions once the connections accepted
// are closed, at most ShutdownGrace later (then it cuts them). Accept
// returns net.ErrClosed from now on. Close is idempotent.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		l.closeQueue()
		grace := l.a.cfg.ShutdownGrace
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), grace)
			defer cancel()
			// Leave returns when Run returned; at the end of the grace,
			// Run cuts what is left by itself.
			_ = l.a.Leave(ctx)
		}()
	})
	return nil
}

// closeQueue marks the Listener closed and refuses the connections that
// wait for Accept.
func (l *Listener) closeQueue() {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.closed:
		return
	default:
	}
	close(l.closed)
	for {
		select {
		case c := <-l.queue:
			c.refused(tunnelpb.Error_REFUSED, ConnUnknownRoute, errListenerClosed)
		default:
			return
		}
	}
}

// Shutdown closes the Listener (Close) and waits until the agent ended its
// sessions: every connection accepted is closed, or ShutdownGrace is over.
// When ctx ends first, the connections still open are cut and Shutdown
// returns ctx's error once the agent stopped. Pair it with
// http.Server.Shutdown, which closes the connections as they go idle.
func (l *Listener) Shutdown(ctx context.Context) error {
	l.Close()
	select {
	case <-l.done:
		return nil
	case <-ctx.Done():
		l.stop()
		<-l.done
		return ctx.Err()
	}
}

// Done is closed once the agent stopped: after Close (or Shutdown), once
// its sessions ended.
func (l *Listener) Done() <-chan struct{} { return l.done }

// Addr returns the Listener's routes (a ListenAddr), as a net.Listener
// reports where it listens.
func (l *Listener) Addr() net.Addr { return l.addr }

// Agent returns the agent that serves the Listener's routes, for its
// state, status and statistics (Agent.Status, Agent.Ready, Agent.Stats).
// Its Run and Leave belong to the Listener.
func (l *Listener) Agent() *Agent { return l.a }

// deliver queues c for Accept, unless the Listener is closed or its
// backlog is full.
func (l *Listener) deliver(c *Conn) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.closed:
		return errListenerClosed
	default:
	}
	select {
	case l.queue <- c:
		return nil
	default:
		return errBacklogFull
	}
}

// ListenAddr is a Listener's address: the names of the routes it serves
// (a route's name defaults to its host, host pattern or ":<listen_port>").
type ListenAddr struct {
	Routes []string
}

// Network returns "sluice".
func (ListenAddr) Network() string { return "sluice" }

// String returns the route names, separated by commas.
func (a ListenAddr) String() string { return strings.Join(a.Routes, ",") }

// Conn is a connection accepted from a Listener: a virtual connection of
// the tunnel (a *tunnelcore.Conn), which implements net.Conn with
// deadlines, and CloseWrite to half-close. Its RemoteAddr is the public
// client's address when the node knew it.
//
// Close every accepted Conn: it holds one of the agent's max_connections
// until then (also once the node or the session ended it).
type Conn struct {
	*tunnelcore.Conn
	once sync.Once
	end  func(outcome ConnOutcome, err error) // reports it, frees its slot
}

// Route returns the name of the route the node routed the connection to.
func (c *Conn) Route() string { return c.Info().RouteKey }

// ServerName returns the TLS server name of a tls_passthrough route's
// connection ("" for others).
func (c *Conn) ServerName() string { return c.Info().ServerName }

// Close closes the connection (bytes written are still delivered, then
// EOF) and gives back its slot.
func (c *Conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.end(ConnOK, nil) })
	return err
}

// refused answers a connection Accept never returned.
func (c *Conn) refused(code tunnelpb.Error_Code, outcome ConnOutcome, err error) {
	c.Conn.Abort(code, err.Error())
	c.once.Do(func() { c.end(outcome, err) })
}

// handOver gives conn, which holds a slot (acquire), to the Listener of
// its route, or refuses it when the Listener is closed or its backlog
// full. The slot and the report wait for the Conn's Close.
func (c *connector) handOver(conn *tunnelcore.Conn, up *upstream, rep *ConnReport) {
	r := *rep
	lc := &Conn{Conn: conn}
	lc.end = func(outcome ConnOutcome, err error) {
		r.FromClient, r.ToClient = conn.Counts()
		r.Outcome, r.Err = outcome, err
		c.release()
		c.finish(&r) // after release: a report's connection is out of Active
		c.wg.Done()
	}
	err := up.local.deliver(lc)
	switch {
	case err == nil:
		c.log.Debug("connection handed to the listener", zap.String("route", up.cfg.Name), zap.Uint64("conn_id", conn.ID()),
			zap.String("remote_addr", r.ClientAddr))
	case errors.Is(err, errBacklogFull):
		if ok, suppressed := up.dialLog.Allow(); ok {
			c.log.Warn("connection refused: the listener's backlog is full", zap.String("route", up.cfg.Name),
				zap.Int("backlog", listenBacklog), zap.Int("suppressed", suppressed))
		}
		lc.refused(tunnelpb.Error_RESOURCE_EXHAUSTED, ConnLimit, err)
	default:
		c.log.Debug("connection refused: the listener is closed", zap.String("route", up.cfg.Name), zap.Uint64("conn_id", conn.ID()))
		lc.refused(tunnelpb.Error_REFUSED, ConnUnknownRoute, err)
	}
}

// Interface guards.
var (
	_ net.Listener                    = (*Listener)(nil)
	_ net.Conn                        = (*Conn)(nil)
	_ net.Addr                        = ListenAddr{}
	_ interface{ CloseWrite() error } = (*Conn)(nil)
)
