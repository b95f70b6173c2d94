package caddymodule

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// node is what outlives a config reload: the control-plane listener, the
// gRPC server on it, the agent sessions and their routes. Apps of successive
// configs share one node per control address through nodePool, so a reload
// drops no agent and no in-flight connection.
type node struct {
	addr   string
	server *grpc.Server
	reg    *registry
	ports  *portManager
	udp    udpNode // datagram flows: their limits, counters and UDP ports (udp.go)
	lanes  laneTickets
	direct directKeys
	budget *tunnelcore.Budget
	slots  *tunnelcore.Slots

	clients        *addrLimiter // HTTP requests in flight and TCP relays, by client address
	pending        counterLimiter
	pendingByAddr  *addrLimiter
	sessions       counterLimiter
	sessionsByAddr *addrLimiter
	sessionsByCred *addrLimiter // by credential name (Scope.MaxSessions)
	limitLog       *logthrottle.Throttle
	streamLog      *logthrottle.Throttle
	sessionLog     *logthrottle.Throttle // agent connected, replaced, disconnected
	acceptLog      *logthrottle.Throttle // accept errors on agents' ports
	agentErrLog    *logthrottle.Throttle // Error frames agents send
	portLog        *logthrottle.Throttle // agent port routes rejected
	scopeLog       *logthrottle.Throttle // routes out of scope, shadowed routes
	portBindLog    *logthrottle.Throttle // agent ports bound and released
	guard          *connGuard            // the control listener's connections that have not authenticated
	authLog        *logthrottle.Throttle // credentials refused
	accessLog      *logthrottle.Throttle // TCP access lines (logTCPAccess): 100 a second
	authFailures   atomic.Int64          // streams refused for their credential
	metrics        nodeCounters          // the counters the metrics report (metrics.go)
	draining       atomic.Bool
	drainCtx       context.Context // cancelled when the node starts draining
	drainNow       context.CancelFunc
	refused        atomic.Int64 // connections and requests refused by a limit
	awaitingAgent  atomic.Int64 // requests waiting for an agent to serve their host
	id             string

	logger atomic.Pointer[zap.Logger]
	// creds are the credentials of the current config (App.Start).
	creds atomic.Pointer[credentialSet]
	// tls is whether the control plane serves TLS, fixed when the listener
	// is made; ctls is the current config's certificate and client
	// certificate verification, which a reload replaces (tlsConfig).
	tls  bool
	ctls atomic.Pointer[controlTLS]
	opts atomic.Pointer[nodeOptions]

	// admitMu serialises route admissions (a session's first Advertise,
	// a repeated one, and the re-admission when a reload changes the port
	// options), so each sees the options stored before it.
	admitMu sync.Mutex

	mu          sync.Mutex
	idleClosers map[any]func() // each transport's CloseIdleConnections (closeIdleConns)

	// serveMu guards the control listener's lifecycle: the node listens
	// only once a config using its address starts (App.Start), so that
	// `caddy validate`, which provisions without starting, binds nothing.
	serveMu    sync.Mutex
	serveState serveState
	listener   net.Listener  // set when serving
	started    time.Time     // when it started serving
	serveDone  chan struct{} // closed when the gRPC server stopped serving
}

// serveState is where a node's control listener is in its life.
type serveState uint8

const (
	serveIdle    serveState = iota // provisioned, not listening yet
	serveServing                   // listening and serving agents
	serveStopped                   // shut down (Destruct); never serves again
)

// errNodeStopped is a start of a node that was shut down already.
var errNodeStopped = errors.New("sluice control plane already shut down")

// nodeOptions are the settings the current config gives the node.
type nodeOptions struct {
	advertiseTimeout    time.Duration
	maxConnsPerAddr     int
	maxSessions         int
	maxSessionsPerAddr  int
	maxPending          int
	maxPendingPerAddr   int
	stallTimeout        time.Duration
	drainGrace          time.Duration
	portRange           portRange     // ports agents may claim; zero: the node binds none
	tcpBind             string        // host the claimed ports bind on ("" = all)
	verbatimIdleTimeout time.Duration // default idle bound of relayed TCP connections; 0 = off
	noDataLane          bool          // offer agents no data lane (App.DisableDataLane)
	noDirectSockets     bool          // offer agents no direct sockets (App.DisableDirectSockets)
	nodeID              string        // the node label of its metrics (App.NodeID)
	warmup              time.Duration // readiness down this long after the listener started serving (App.Warmup)
	cluster             *membership   // the cluster's members (App.Cluster); nil: none
	udp                 udpNodeOptions
}

// nodeKey identifies a node in the pool.
type nodeKey string

// newNode makes the node of a control address; serve starts it.
func newNode(addr string, ctls *controlTLS, logger *zap.Logger) *node {
	n := &node{
		addr:   addr,
		reg:    newRegistry(),
		budget: tunnelcore.NewBudget(tunnelcore.DefaultBudget),
		slots:  tunnelcore.NewSlots(0),

		clients:        newAddrLimiter(),
		pendingByAddr:  newAddrLimiter(),
		sessionsByAddr: newAddrLimiter(),
		sessionsByCred: newAddrLimiter(),
		limitLog:       logthrottle.New(10*time.Second, 5),
		streamLog:      logthrottle.New(10*time.Second, 5),
		sessionLog:     logthrottle.New(10*time.Second, 32),
		acceptLog:      logthrottle.New(10*time.Second, 1),
		agentErrLog:    logthrottle.New(10*time.Second, 5),
		portLog:        logthrottle.New(time.Minute, 5),
		scopeLog:       logthrottle.New(time.Minute, 10),
		portBindLog:    logthrottle.New(10*time.Second, 64),
		authLog:        logthrottle.New(10*time.Second, 5),
		accessLog:      logthrottle.New(time.Second, 100),
		idleClosers:    map[any]func(){},
	}
	n.ports = newPortManager(n)
	n.udp.init(n)
	n.guard = newConnGuard(n)
	n.drainCtx, n.drainNow = context.WithCancel(context.Background())
	go n.watchExit()
	n.logger.Store(logger)
	n.opts.Store(&nodeOptions{advertiseTimeout: 10 * time.Second, drainGrace: 10 * time.Second})
	opts := []grpc.ServerOption{
		grpc.ForceServerCodecV2(tunnelpb.Codec{}),
		experimental.BufferPool(tunnelcore.BufferPool()),
		grpc.ReadBufferSize(tunnelcore.GRPCBufferSize),
		grpc.WriteBufferSize(tunnelcore.GRPCBufferSize),
		grpc.InitialWindowSize(tunnelcore.GRPCWindowSize),
		grpc.InitialConnWindowSize(tunnelcore.GRPCWindowSize),
		// Before a token is checked, a connection costs what these allow:
		// the transport's buffers, a 16 KiB header block (gRPC's default,
		// 16 MiB, let an unfinished one pin that much per connection) and
		// 10 s to finish the handshake (the guard closes it sooner when it
		// is silent). The token is checked on a stream's headers, before
		// any message is read (tapAuthenticate), so the message size and
		// windows below are what authenticated streams get. An agent's
		// connection always carries its Connect stream, so it is never
		// idle.
		grpc.InTapHandle(n.tapAuthenticate),
		grpc.MaxHeaderListSize(16 << 10),
		grpc.MaxConcurrentStreams(16),
		grpc.ConnectionTimeout(10 * time.Second),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, MaxConnectionIdle: 2 * time.Minute}),
		// Agents ping every 30 s even with no stream open; allow down to 10 s.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	// The credentials also record each connection's socket progress, so
	// the stall watchdog tells a stalled agent from a slow link.
	creds := insecure.NewCredentials()
	if ctls != nil {
		n.tls = true
		n.ctls.Store(ctls)
		// Each handshake reads the TLS the current config stored, so a
		// reload renews the certificate and changes client
		// verification without a new listener.
		creds = n.tlsCreds()
	}
	opts = append(opts, grpc.Creds(&laneCreds{
		TransportCredentials: tunnelcore.ProgressCredentials(creds),
		tickets:              &n.lanes,
		direct:               n.directKeys(),
		refused:              n.laneRefused,
	}))
	n.server = grpc.NewServer(opts...)
	tunnelpb.RegisterTunnelServer(n.server, &tunnelService{n: n})
	return n
}

// serve starts serving agents on the listener listen makes, unless the
// node serves already.
func (n *node) serve(listen func() (net.Listener, error)) error {
	n.serveMu.Lock()
	defer n.serveMu.Unlock()
	switch n.serveState {
	case serveServing:
		return nil
	case serveStopped:
		return errNodeStopped
	}
	ln, err := listen()
	if err != nil {
		return err
	}
	n.listener, n.serveState, n.serveDone = ln, serveServing, make(chan struct{})
	n.started = time.Now() // with its monotonic reading: warm-up compares against it
	n.id = ln.Addr().String()
	n.guard.Listener = ln
	go func() {
		defer close(n.serveDone)
		if err := n.server.Serve(n.guard); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log().Error("sluice control plane stopped serving", zap.String("listen", n.addr), zap.Error(err))
		}
	}()
	return nil
}

// servingSince returns when the node started serving, in UTC; zero
// before. A reload keeps it: the node serves on.
func (n *node) servingSince() time.Time {
	n.serveMu.Lock()
	defer n.serveMu.Unlock()
	return n.started.UTC()
}

// stopServing stops the gRPC server (closing the listener and every
// connection) and waits until it returned.
func (n *node) stopServing() {
	n.serveMu.Lock()
	served := n.serveState == serveServing
	n.serveState = serveStopped
	n.serveMu.Unlock()
	n.server.Stop()
	if served {
		<-n.serveDone
	}
}

func (n *node) log() *zap.Logger { return n.logger.Load() }

// errNodeShutDown ends every session when the last config using the
// control address is unloaded (after the drain grace).
var errNodeShutDown = errors.New("sluice node shut down")

// Destruct implements caddy.Destructor: the last config using this control
// address was unloaded.
func (n *node) Destruct() error {
	n.drain()
	for _, a := range n.reg.sessions() {
		a.sess.CloseWithError(errNodeShutDown)
	}
	n.stopServing()
	n.log().Info("sluice control plane closed", zap.String("listen", n.addr))
	return nil
}

// registerIdleCloser registers a transport's fn that closes its idle
// pooled connections (see closeIdleConns).
func (n *node) registerIdleCloser(key any, fn func()) {
	n.mu.Lock()
	n.idleClosers[key] = fn
	n.mu.Unlock()
}

func (n *node) unregisterIdleCloser(key any) {
	n.mu.Lock()
	delete(n.idleClosers, key)
	n.mu.Unlock()
}

// closeIdleConns closes the idle keep-alive connections every transport
// pools. Each holds a connection slot: they are closed when an Open finds
// every slot of max_connections taken (node.open: so pooled idle
// connections do not starve new ones for the transport's idle timeout),
// and when the node drains (they are not in flight).
func (n *node) closeIdleConns() {
	n.mu.Lock()
	fns := make([]func(), 0, len(n.idleClosers))
	for _, fn := range n.idleClosers {
		fns = append(fns, fn)
	}
	n.mu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

// connectionsOpen sums the open virtual connections of every session.
func (n *node) connectionsOpen() int {
	total := 0
	for _, a := range n.reg.sessions() {
		total += a.sess.NumConns()
	}
	return total
}

// Bounds of the reconnect spread a draining node asks of its agents
// (reconnectSpread).
const (
	reconnectSpreadPerSession = 2 * time.Millisecond
	reconnectSpreadMin        = time.Second
	reconnectSpreadMax        = time.Minute
)

// reconnectSpread is the Drain's reconnect_spread_ms for a node draining
// sessions sessions: the window over which its agents draw their first
// reconnect attempt, 2 ms per session, at least 1 s and at most 60 s
// (10,000 sessions: 20 s). Drained agents otherwise all come back within
// about a second, to this node restarted or to the others, and a node
// admits on the order of a thousand sessions a second on a small machine:
// 10,000 at once kept a new node's probes waiting 5 s (issue 25). Spread,
// they arrive at some 500 a second and the node stays responsive; a node
// with a few agents keeps today's ~1 s (1 s is the agent's own backoff,
// so a spread of 1 s changes nothing for them).
func reconnectSpread(sessions int) time.Duration {
	return min(max(time.Duration(sessions)*reconnectSpreadPerSession, reconnectSpreadMin), reconnectSpreadMax)
}

// drain stops new tunnel streams and port connections, tells the agents,
// and waits (up to drain_grace) for open virtual connections to finish.
func (n *node) drain() {
	n.admitMu.Lock() // see Connect: no session registers past this unseen
	n.draining.Store(true)
	sessions := n.reg.sessions()
	n.admitMu.Unlock()
	n.drainNow()
	n.ports.closeAll()
	n.udp.ports.closeAll()
	n.closeIdleConns() // idle pooled connections are not in flight: do not wait for them
	grace := n.opts.Load().drainGrace
	spread := reconnectSpread(len(sessions))
	for _, a := range sessions {
		a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{
			GraceMs: uint32(grace / time.Millisecond), Reason: "node shutting down",
			ReconnectSpreadMs: uint32(spread / time.Millisecond),
		}}})
	}
	deadline := time.Now().Add(grace)
	open := n.connectionsOpen()
	for open > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		open = n.connectionsOpen()
	}
	if open > 0 {
		n.log().Warn("drain grace over; closing open tunnel connections", zap.Int("connections", open), zap.Duration("drain_grace", grace))
	}
}

// watchExit starts the drain as soon as the process begins to exit: Caddy
// stops the HTTP servers before it cleans up apps, and with streams open
// that stop would otherwise wait for them forever.
func (n *node) watchExit() {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-n.drainCtx.Done():
			return
		case <-tick.C:
			if caddy.Exiting() {
				n.log().Info("process exiting; draining tunnels", zap.Duration("drain_grace", n.opts.Load().drainGrace))
				n.draining.Store(true)
				n.drainNow()
				return
			}
		}
	}
}
