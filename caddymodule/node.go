package caddymodule

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/ident"
	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// idClashWindow: a session that itself replaced one of its id and is
// replaced in turn this soon after it connected is most likely one of two
// agents running with one id, which take turns serving, each displacing the
// other, with 503s in between (an agent's own reconnect, after a restart or
// a network blip, replaces a session once). msgIDClash is what the node
// then logs, at WARN.
const (
	idClashWindow = time.Minute
	msgIDClash    = "agent session replaced by a newer stream soon after it connected; are two agents running with this id?"
)

// node is what outlives a config reload: the control-plane listener, the
// gRPC server on it, the agent sessions and their routes. Apps of successive
// configs share one node per control address through nodePool, so a reload
// drops no agent and no in-flight connection.
type node struct {
	addr     string
	listener net.Listener
	server   *grpc.Server
	reg      *registry
	ports    *portManager
	lanes    laneTickets
	direct   directKeys
	budget   *tunnelcore.Budget
	slots    *tunnelcore.Slots

	clients        *addrLimiter // HTTP requests in flight and TCP relays, by client address
	pending        counterLimiter
	pendingByAddr  *addrLimiter
	sessions       counterLimiter
	sessionsByAddr *addrLimiter
	limitLog       *logthrottle.Throttle
	streamLog      *logthrottle.Throttle
	sessionLog     *logthrottle.Throttle // agent connected, replaced, disconnected
	acceptLog      *logthrottle.Throttle // accept errors on agents' ports
	agentErrLog    *logthrottle.Throttle // Error frames agents send
	portLog        *logthrottle.Throttle // agent port routes rejected
	portBindLog    *logthrottle.Throttle // agent ports bound and released
	guard          *connGuard            // the control listener's connections that have not authenticated
	authLog        *logthrottle.Throttle // credentials refused
	authFailures   atomic.Int64          // streams refused for their credential
	draining       atomic.Bool
	drainCtx       context.Context // cancelled when the node starts draining
	drainNow       context.CancelFunc
	refused        atomic.Int64 // connections and requests refused by a limit
	awaitingAgent  atomic.Int64 // requests waiting for an agent to serve their host
	id             string

	logger atomic.Pointer[zap.Logger]
	token  atomic.Pointer[string]
	// tls is whether the control plane serves TLS, fixed when the listener
	// is made; cert is the certificate it serves, which a reload replaces.
	tls  bool
	cert atomic.Pointer[tls.Certificate]
	opts atomic.Pointer[nodeOptions]

	// admitMu serialises route admissions (a session's first Advertise,
	// a repeated one, and the re-admission when a reload changes the port
	// options), so each sees the options stored before it.
	admitMu sync.Mutex

	mu          sync.Mutex
	idleClosers map[any]func() // each transport's CloseIdleConnections (closeIdleConns)

	serveDone chan struct{}
}

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
}

// nodeKey identifies a node in the pool.
type nodeKey string

func newNode(addr string, ln net.Listener, cert *tls.Certificate, logger *zap.Logger) *node {
	n := &node{
		addr:     addr,
		listener: ln,
		reg:      newRegistry(),
		budget:   tunnelcore.NewBudget(tunnelcore.DefaultBudget),
		slots:    tunnelcore.NewSlots(0),

		clients:        newAddrLimiter(),
		pendingByAddr:  newAddrLimiter(),
		sessionsByAddr: newAddrLimiter(),
		limitLog:       logthrottle.New(10*time.Second, 5),
		streamLog:      logthrottle.New(10*time.Second, 5),
		sessionLog:     logthrottle.New(10*time.Second, 32),
		acceptLog:      logthrottle.New(10*time.Second, 1),
		agentErrLog:    logthrottle.New(10*time.Second, 5),
		portLog:        logthrottle.New(time.Minute, 5),
		portBindLog:    logthrottle.New(10*time.Second, 64),
		authLog:        logthrottle.New(10*time.Second, 5),
		id:             ln.Addr().String(),
		idleClosers:    map[any]func(){},
		serveDone:      make(chan struct{}),
	}
	n.ports = newPortManager(n)
	n.guard = newConnGuard(ln, n)
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
	if cert != nil {
		n.tls = true
		n.cert.Store(cert)
		// Each handshake reads the certificate the current config
		// stored, so a reload renews it without a new listener.
		creds = credentials.NewTLS(&tls.Config{
			MinVersion: tls.VersionTLS12,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
				return n.cert.Load(), nil
			},
		})
	}
	opts = append(opts, grpc.Creds(&laneCreds{
		TransportCredentials: tunnelcore.ProgressCredentials(creds),
		tickets:              &n.lanes,
		direct:               n.directKeys(),
		refused:              n.laneRefused,
	}))
	n.server = grpc.NewServer(opts...)
	tunnelpb.RegisterTunnelServer(n.server, &tunnelService{n: n})
	go func() {
		defer close(n.serveDone)
		if err := n.server.Serve(n.guard); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log().Error("sluice control plane stopped serving", zap.String("listen", addr), zap.Error(err))
		}
	}()
	return n
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
	n.server.Stop()
	<-n.serveDone
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

// tunnelService implements the Tunnel gRPC service.
type tunnelService struct {
	tunnelpb.UnimplementedTunnelServer
	n *node
}

// ListNodes returns this node; a cluster's membership comes later. Its
// caller authenticated in the tap (tapAuthenticate).
func (s *tunnelService) ListNodes(ctx context.Context, _ *tunnelpb.ListNodesRequest) (*tunnelpb.NodeList, error) {
	if _, err := authenticatedToken(ctx); err != nil {
		return nil, err
	}
	return &tunnelpb.NodeList{Nodes: []*tunnelpb.Node{{Id: s.n.id}}}, nil
}

// errTokenChanged ends the sessions of agents that authenticated with a
// token a reload replaced: a rotated token must lock out whoever held the
// old one, not only their next connection.
var errTokenChanged = errors.New("the node's token changed; reconnect with the new one")

// endSessionsOfOldTokens ends the sessions that authenticated with a token
// other than the node's current one, after a reload that changed it took
// over, and logs how many.
func (n *node) endSessionsOfOldTokens() {
	cur := n.token.Load()
	if cur == nil {
		return
	}
	if ended := n.endSessionsWithout(*cur); ended > 0 {
		n.log().Warn("sluice: token changed; ended the sessions that authenticated with the old one", zap.Int("sessions", ended))
	}
}

// endSessionsWithout closes the sessions that authenticated with another
// token than token.
func (n *node) endSessionsWithout(token string) int {
	ended := 0
	for _, a := range n.reg.sessions() {
		if a.token != token {
			a.sess.CloseWithError(errTokenChanged)
			ended++
		}
	}
	return ended
}

// Connect serves one agent stream: authorize, read the Advertise, register
// the session, answer with AdvertiseAck, and keep it until the stream ends.
func (s *tunnelService) Connect(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	n := s.n
	ctx := stream.Context()
	remote := "unknown"
	var progress func() uint64
	if p, ok := peer.FromContext(ctx); ok {
		remote = p.Addr.String()
		progress = tunnelcore.ProgressOf(p.AuthInfo)
	}
	if n.draining.Load() {
		return status.Error(codes.Unavailable, errDrainingNode.Error())
	}
	token, err := authenticatedToken(ctx)
	if err != nil {
		return err
	}
	opts := n.opts.Load()
	releasePending, err := n.admitStream(remote, opts)
	if err != nil {
		n.logStream("agent stream refused", remote, err)
		return err
	}
	lanes, directKey, withdrawLane := n.offerLane(stream)
	op, err := n.readAdvertise(stream, lanes)
	withdrawLane()
	releasePending()
	if err != nil {
		n.logStream("agent rejected", remote, err)
		return err
	}
	adv := op.adv
	sessionRan := false
	if op.lane != nil {
		// Closed when the handler returns, whichever way: unused when the
		// stream is refused, else after the session's last frames (see
		// closeLane).
		defer func() { closeLane(op.frames, sessionRan) }()
	}
	releaseSession, err := n.admitSession(remote, adv.GetAgentId(), opts)
	if err != nil {
		n.logStream("agent session refused", remote, err)
		return err
	}
	defer releaseSession()
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("x-sluice-id")) > 0 && md.Get("x-sluice-id")[0] != adv.GetAgentId() {
		return status.Errorf(codes.InvalidArgument, "x-sluice-id %q does not match the advertised agent id %q", md.Get("x-sluice-id")[0], adv.GetAgentId())
	}

	streamCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	a := &agentSession{agentID: adv.GetAgentId(), remote: remote, build: adv.GetBuild(), connected: time.Now(), token: token}
	// admitMu from before the session's receive loop starts: a second
	// Advertise waits until the first is admitted and registered.
	n.admitMu.Lock()
	// A reload may have changed the token while this stream waited for its
	// Advertise: refused before it is registered, so that a stream with a
	// token no longer valid cannot displace the agent's current session.
	if cur := n.token.Load(); cur == nil || *cur != token {
		n.admitMu.Unlock()
		err := status.Error(codes.Unauthenticated, "the node's token changed while the stream waited for its Advertise")
		n.logStream("agent rejected", remote, err)
		return err
	}
	// drain marks the node draining and lists the sessions to tell under
	// admitMu: a session registered after that is refused here instead of
	// serving on a node going away without its Drain.
	if n.draining.Load() {
		n.admitMu.Unlock()
		return status.Error(codes.Unavailable, errDrainingNode.Error())
	}
	frames := tunnelcore.GRPCStream(stream, cancel)
	if op.lane != nil {
		frames = &laneStream{LaneStream: op.frames, endGRPC: cancel}
		progress = tunnelcore.ConnProgress(op.lane)
	}
	sess, err := tunnelcore.NewSession(frames, tunnelcore.Config{
		Role:         tunnelcore.RoleNode,
		PeerWindow:   adv.GetInitialWindow(),
		Budget:       n.budget,
		Slots:        n.slots,
		StallTimeout: opts.stallTimeout,
		Progress:     progress,
		Logger:       n.log().With(zap.String("agent", a.agentID)),
		OnControl:    func(f *tunnelpb.Frame) { n.onControl(a, f) },
	})
	if err != nil {
		n.admitMu.Unlock()
		frames.Close(err)
		return status.Error(codes.Internal, err.Error())
	}
	if op.lane != nil {
		sessionRan = true
		go endWithGRPCStream(sess, op.grpcRecv)
		if directKey != "" {
			n.direct.register(directKey, sess)
			defer n.direct.forget(directKey)
		}
	}
	a.sess = sess
	a.advertised = adv.GetRoutes()
	entries, rejected := n.admit(a, a.advertised, nil)
	if old := n.reg.register(a, entries); old != nil {
		a.displaced = true
		// The displaced session ends now: left open, it would hold its
		// place in max_sessions while serving nothing (and a client
		// reusing one id could open any number of them).
		old.sess.CloseWithError(errReplaced)
		if ok, suppressed := n.sessionLog.Allow(); ok {
			fields := []zap.Field{zap.String("agent", a.agentID), zap.String("old_remote", old.remote),
				zap.String("remote", remote), zap.Int("suppressed_since_last", suppressed)}
			if lived := time.Since(old.connected); old.displaced && lived < idClashWindow {
				n.log().Warn(msgIDClash, append(fields, zap.Duration("replaced_after", lived.Round(time.Millisecond)))...)
			} else {
				n.log().Info("agent session replaced by a newer stream", fields...)
			}
		}
	}
	n.sendAck(a, rejected)
	n.admitMu.Unlock()
	// A reload may have changed the token since this stream's was checked
	// (it waited for its Advertise meanwhile): the reload's sweep of old
	// sessions ran before this one was registered.
	if cur := n.token.Load(); cur == nil || *cur != token {
		sess.CloseWithError(errTokenChanged)
	}
	go refuseAgentOpened(streamCtx, sess)
	// stall_progress: whether the stall watchdog reads the connection's
	// progress (else it times blocked sends alone; see tunnelcore).
	if ok, suppressed := n.sessionLog.Allow(); ok {
		n.log().Info("agent connected", zap.String("agent", a.agentID), zap.String("remote", remote),
			zap.String("build", a.build), zap.Strings("routes", names(entries)), zap.Int("rejected", len(rejected)),
			zap.Bool("data_lane", op.lane != nil), zap.Bool("direct_sockets", op.lane != nil && directKey != ""),
			zap.Bool("stall_progress", progress != nil),
			zap.Int("suppressed_since_last", suppressed))
	}

	select {
	case <-sess.Done():
	case <-streamCtx.Done():
		sess.CloseWithError(context.Cause(streamCtx))
	}
	// Under admitMu, so a re-admission of this session (a reload changing
	// the port options) cannot claim ports after they were released here.
	n.admitMu.Lock()
	unregistered := n.reg.unregister(a)
	n.releasePorts(a.currentRoutes(&n.reg.mu))
	n.admitMu.Unlock()
	if unregistered {
		if ok, suppressed := n.sessionLog.Allow(); ok {
			n.log().Info("agent disconnected", zap.String("agent", a.agentID), zap.String("remote", remote),
				zap.NamedError("reason", sess.Err()), zap.Int("suppressed_since_last", suppressed))
		}
	}
	// Its pooled virtual connections failed with the session, and their
	// dial addresses left the route table: net/http drops them itself. The
	// other agents' pools are left alone.
	switch {
	case errors.Is(sess.Err(), errReplaced):
		return status.Errorf(codes.Aborted, "%v (agent id %q)", errReplaced, a.agentID)
	case errors.Is(sess.Err(), errTokenChanged):
		return status.Error(codes.Unauthenticated, errTokenChanged.Error())
	case errors.Is(sess.Err(), errLeaveGraceOver):
		return status.Error(codes.DeadlineExceeded, errLeaveGraceOver.Error())
	}
	return nil
}

// offerLane offers the stream a data lane (unless the node's data_lane is
// off) and with it direct sockets (unless direct_sockets is off) in the
// response header, which it sends at once either way: an agent waits for
// the header before it sends its Advertise. The lane that claims the
// ticket arrives on lanes; withdraw gives the offer up. directKey is the
// key the session's direct sockets will present, once registered.
func (n *node) offerLane(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) (lanes <-chan net.Conn, directKey string, withdraw func()) {
	md := metadata.MD{}
	withdraw = func() {}
	if opts := n.opts.Load(); !opts.noDataLane {
		var ticket string
		ticket, lanes, withdraw = n.lanes.offer()
		md.Set(tunnelpb.LaneHeader, ticket)
		if !opts.noDirectSockets {
			directKey = randomHex(tunnelpb.DirectKeyLength)
			md.Set(tunnelpb.DirectHeader, directKey)
		}
	}
	if err := stream.SendHeader(md); err != nil {
		withdraw()
		return nil, "", func() {}
	}
	return lanes, directKey, withdraw
}

// laneLinger bounds how long a lane whose session ended waits for the
// agent to close its end before the node closes it (closeLane).
const laneLinger = time.Second

// closeLane closes a lane. After a session, the node has half-closed it
// (laneStream.Close) and the session's receive loop reads what the agent
// still sends until the agent, having read the node's last frames, closes
// its end; only then is the lane closed, as closing it with bytes unread
// would reset it and could discard what the agent had not read yet (such
// as the answer to its Drain). An agent that does not close within
// laneLinger is cut.
func closeLane(lane tunnelcore.LaneStream, sessionRan bool) {
	if sessionRan {
		lane.CloseWrite()
		t := time.NewTimer(laneLinger)
		select {
		case <-lane.RecvEnded():
		case <-t.C:
		}
		t.Stop()
	}
	lane.Close(nil)
}

// endWithGRPCStream ends a session on a data lane when the gRPC stream
// beside it ends, or carries a frame it must not.
func endWithGRPCStream(sess *tunnelcore.Session, grpcRecv <-chan recvResult) {
	select {
	case r := <-grpcRecv:
		if r.err == nil {
			r.env.Payload.Free()
			r.err = errFrameBesideLane
		}
		sess.CloseWithError(r.err)
	case <-sess.Done():
	}
}

// directKeys returns the node's direct socket keys, refusing sockets
// while the current config has direct_sockets off.
func (n *node) directKeys() *directKeys {
	n.direct.off = func() bool { return n.opts.Load().noDirectSockets }
	return &n.direct
}

// laneRefused logs a lane connection that presented no ticket the node is
// waiting for (a lane that came too late, or not an agent), or a direct
// socket whose key or connection the node does not have (what names
// which).
func (n *node) laneRefused(remote net.Addr, what string, err error) {
	if ok, suppressed := n.streamLog.Allow(); ok {
		n.log().Info(what+" refused", zap.Stringer("remote", remote), zap.Error(err),
			zap.Int("suppressed_since_last", suppressed))
	}
}

// errReplaced ends a session that a newer stream of the same agent id
// replaced. The agent gets it as ABORTED: two live agents sharing an id
// displace each other at their reconnect pace.
var errReplaced = errors.New(tunnelpb.StatusReplaced)

// recvResult is one receive of an agent's first frame.
type recvResult struct {
	env *tunnelpb.Envelope
	err error
}

// opening is how an agent opened its session: its Advertise, and the lane
// it attached (nil: the session runs on the gRPC stream). On a lane,
// grpcRecv is the gRPC stream's receive still pending: the agent sends
// nothing more there, so it completes when the stream ends or the agent
// breaks the protocol.
type opening struct {
	adv      *tunnelpb.Advertise
	lane     net.Conn
	frames   tunnelcore.LaneStream // the lane's
	grpcRecv <-chan recvResult
}

// readAdvertise waits for the agent's first frame, which must be Advertise:
// on the gRPC stream, or on the lane the agent attached with the ticket
// this stream was offered (lanes; nil when none was).
func (n *node) readAdvertise(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame], lanes <-chan net.Conn) (opening, error) {
	ch := make(chan recvResult, 1)
	go func() {
		env := &tunnelpb.Envelope{}
		err := stream.RecvMsg(env)
		ch <- recvResult{env, err}
	}()
	timeout := n.opts.Load().advertiseTimeout
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var r recvResult
	var op opening
	// A stream still waiting when the node starts draining is ended then:
	// it would register on a node going away, after the Drain went out.
	draining := n.drainCtx.Done()
	select {
	case r = <-ch:
	case conn := <-lanes:
		op = opening{lane: conn, frames: tunnelcore.ConnStream(conn), grpcRecv: ch}
		r = readLaneAdvertise(conn, op.frames, ch, timer.C, draining)
	case <-timer.C:
		r.err = errNoAdvertise
	case <-draining:
		r.err = errDrainingNode
	}
	var err error
	switch {
	case errors.Is(r.err, errNoAdvertise):
		err = status.Errorf(codes.DeadlineExceeded, "no Advertise within %v", timeout)
	case errors.Is(r.err, errDrainingNode):
		err = status.Error(codes.Unavailable, errDrainingNode.Error())
	default:
		op.adv, err = checkAdvertise(r)
	}
	if err != nil && op.frames != nil {
		op.frames.Close(err) // the lane of a refused stream
	}
	return op, err
}

// errNoAdvertise: the Advertise did not come within the advertise timeout.
// errDrainingNode: the node started draining first.
var (
	errNoAdvertise  = errors.New("no Advertise")
	errDrainingNode = errors.New("node is draining")
)

// readLaneAdvertise accepts the lane conn and reads its first frame.
func readLaneAdvertise(conn net.Conn, frames tunnelcore.LaneStream, grpcRecv <-chan recvResult, timeout <-chan time.Time, draining <-chan struct{}) recvResult {
	if _, err := conn.Write([]byte{tunnelpb.LaneAccepted}); err != nil {
		return recvResult{err: status.Errorf(codes.Unavailable, "answering the data lane: %v", err)}
	}
	ch := make(chan recvResult, 1)
	go func() {
		env := &tunnelpb.Envelope{}
		err := frames.Recv(env)
		ch <- recvResult{env, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			r.err = status.Errorf(codes.Unavailable, "data lane: %v", r.err)
		}
		return r
	case r := <-grpcRecv:
		if r.err == nil {
			r.env.Payload.Free()
			r.err = status.Error(codes.FailedPrecondition, errFrameBesideLane.Error())
		}
		frames.Close(r.err)
		<-ch
		return recvResult{err: r.err}
	case <-timeout:
		frames.Close(errNoAdvertise)
		<-ch
		return recvResult{err: errNoAdvertise}
	case <-draining:
		frames.Close(errDrainingNode)
		<-ch
		return recvResult{err: errDrainingNode}
	}
}

// errFrameBesideLane: an agent that attached a data lane sent a frame on
// the gRPC stream too.
var errFrameBesideLane = errors.New("agent sent a frame on the gRPC stream while its session runs on the data lane")

// checkAdvertise checks that an agent's first frame is a valid Advertise.
func checkAdvertise(r recvResult) (*tunnelpb.Advertise, error) {
	if r.err != nil {
		return nil, r.err
	}
	if r.env.IsData() {
		r.env.Payload.Free()
		return nil, status.Error(codes.FailedPrecondition, "first frame must be Advertise, got Data")
	}
	adv := r.env.Frame.GetAdvertise()
	idErr := ident.CheckID(adv.GetAgentId())
	switch {
	case adv == nil:
		return nil, status.Errorf(codes.FailedPrecondition, "first frame must be Advertise, got %T", r.env.Frame.GetKind())
	case adv.GetAgentId() == "":
		return nil, status.Error(codes.InvalidArgument, "Advertise.agent_id is empty")
	case idErr != nil:
		return nil, status.Errorf(codes.InvalidArgument, "Advertise.agent_id: %v", idErr)
	case len(adv.GetBuild()) > maxBuildLength:
		return nil, status.Errorf(codes.InvalidArgument, "Advertise.build longer than %d bytes", maxBuildLength)
	case adv.GetInitialWindow() < tunnelcore.InitialWindow:
		return nil, status.Errorf(codes.FailedPrecondition, "Advertise.initial_window %d below %d: agent too old", adv.GetInitialWindow(), tunnelcore.InitialWindow)
	}
	return adv, nil
}

// sendAck answers an Advertise with the session's routes, or a leaving
// session's Drain with none. Callers hold admitMu.
func (n *node) sendAck(a *agentSession, rejected []*tunnelpb.RejectedRoute) {
	ack := &tunnelpb.AdvertiseAck{NodeId: n.id, InitialWindow: tunnelcore.InitialWindow, Rejected: rejected}
	if !a.leaving.Load() {
		for _, e := range a.routes {
			ack.Accepted = append(ack.Accepted, &tunnelpb.RouteKey{Name: routeName(e.route)})
		}
	}
	a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}})
}

// onControl handles session frames after the handshake. A repeated
// Advertise replaces the agent's routes.
func (n *node) onControl(a *agentSession, f *tunnelpb.Frame) {
	switch k := f.GetKind().(type) {
	case *tunnelpb.Frame_Advertise:
		n.readvertise(a, k.Advertise.GetRoutes())
	case *tunnelpb.Frame_Drain:
		n.leave(a, k.Drain)
	case *tunnelpb.Frame_Error:
		if ok, suppressed := n.agentErrLog.Allow(); ok {
			n.log().Warn("agent reported an error", zap.String("agent", a.agentID),
				zap.String("message", truncate(k.Error.GetMessage(), maxLoggedMessage)), zap.Int("suppressed_since_last", suppressed))
		}
	default:
		n.log().Debug("ignoring frame from agent", zap.String("agent", a.agentID), zap.String("frame", fmt.Sprintf("%T", k)))
	}
}

// readvertiseEvery paces an agent's repeated Advertises (an agent retries
// its rejected routes with a backoff of a second and more): one admitted in
// less than this after the last waits for its turn, and a newer one takes
// its place. Each re-admission holds the node-wide admitMu and answers with
// an ack listing every route, so an agent sending Advertises without pause
// would otherwise keep every other agent's connect, leave and reload
// waiting, and pile acks up in its queue.
const readvertiseEvery = time.Second

// readvertise admits a repeated Advertise of a, at its turn.
func (n *node) readvertise(a *agentSession, routes []*tunnelpb.Route) {
	rv := &a.readv
	rv.mu.Lock()
	defer rv.mu.Unlock()
	if wait := readvertiseEvery - time.Since(rv.last); wait > 0 {
		rv.pending = routes
		if !rv.waiting {
			rv.waiting = true
			time.AfterFunc(wait, func() { n.readvertiseDue(a) })
		}
		return
	}
	n.readvertiseLocked(a, routes)
}

// readvertiseDue admits the Advertise that waited for its turn.
func (n *node) readvertiseDue(a *agentSession) {
	rv := &a.readv
	rv.mu.Lock()
	defer rv.mu.Unlock()
	routes := rv.pending
	rv.pending, rv.waiting = nil, false
	n.readvertiseLocked(a, routes)
}

// readvertiseLocked admits routes now. Callers hold a.readv.mu.
func (n *node) readvertiseLocked(a *agentSession, routes []*tunnelpb.Route) {
	a.readv.last = time.Now()
	n.admitMu.Lock()
	n.readmitLocked(a, routes)
	n.admitMu.Unlock()
}

// leave serves an agent's Drain: the agent is shutting down. Its routes are
// withdrawn from every lookup and its ports released, so new requests and
// connections go to other agents, while the connections it has open run on.
// The answer is an AdvertiseAck with no routes. The session's idle pooled
// HTTP connections are closed (closeIdleHTTP), and the node ends the
// session once no connection is left, or the grace ran out (endWhenIdle).
func (n *node) leave(a *agentSession, d *tunnelpb.Drain) {
	n.admitMu.Lock()
	withdrawn := n.reg.withdraw(a)
	if withdrawn {
		n.releasePorts(a.currentRoutes(&n.reg.mu))
	}
	n.sendAck(a, nil)
	n.admitMu.Unlock()
	if !withdrawn {
		return
	}
	grace := time.Duration(d.GetGraceMs()) * time.Millisecond
	if grace <= 0 || grace > maxLeaveGrace {
		grace = maxLeaveGrace
	}
	if ok, suppressed := n.sessionLog.Allow(); ok {
		n.log().Info("agent leaving; its routes take no new connections", zap.String("agent", a.agentID),
			zap.String("reason", truncate(d.GetReason(), maxLoggedMessage)), zap.Int("open_connections", a.sess.NumConns()),
			zap.Duration("grace", grace), zap.Int("suppressed_since_last", suppressed))
	}
	// Off the session's receive loop: closing a connection sends frames.
	go a.closeIdleHTTP()
	go n.endWhenIdle(a, grace)
}

// closeIdleHTTP closes the pooled HTTP connections of a leaving session
// when none of its requests is in flight: they are all idle then, nothing
// will pick them again, and open they would hold the session until the
// transport's idle timeout. Upgraded connections and TCP relays are left
// to finish. While a RoundTrip is under way (it holds sweepMu for
// reading) it does nothing: that request's end sweeps (requestDone).
func (a *agentSession) closeIdleHTTP() {
	if a.requests.Load() != 0 || !a.sweepMu.TryLock() {
		return
	}
	defer a.sweepMu.Unlock()
	if a.requests.Load() != 0 {
		return
	}
	for _, c := range a.sess.Conns() {
		if h, ok := c.Info().Tag.(*httpConn); ok && !h.upgraded.Load() {
			_ = c.Close()
		}
	}
}

// errAgentLeft ends the session of an agent that left (Drain), and fails
// an open on it once it is being ended: a retryable 503 for HTTP.
// errLeaveGraceOver ends one whose connections outlived its grace.
var (
	errAgentLeft      = errors.New("the agent left (shutting down)")
	errLeaveGraceOver = errors.New("the leaving agent's connections outlived its grace")
)

const (
	// leavePoll is how often the node checks whether a leaving session
	// has no connection left.
	leavePoll = 25 * time.Millisecond
	// leaveSweep is how often it closes the session's idle pooled HTTP
	// connections again: net/http may pool one with no request to tell
	// (a connection dialed for a request that took another).
	leaveSweep = time.Second
	// leaveMargin is how long past the grace its agent announced the node
	// waits before it ends a leaving session itself.
	leaveMargin = 5 * time.Second
	// maxLeaveGrace caps that grace (0, from the agent, is none): a
	// leaving session must end, as its id's successor is admitted past
	// max_sessions.
	maxLeaveGrace = tunnelpb.MaxLeaveGrace
)

// endWhenIdle ends a leaving session once it has no connection open nor
// being opened. The node decides, not the agent: only the node knows of the
// opens it has under way (a request that chose the agent just before its
// routes were withdrawn). An agent that outlives its announced grace (at
// most maxLeaveGrace) by leaveMargin is ended too.
func (n *node) endWhenIdle(a *agentSession, grace time.Duration) {
	over := time.NewTimer(grace + leaveMargin)
	defer over.Stop()
	tick := time.NewTicker(leavePoll)
	defer tick.Stop()
	lastSweep := time.Now()
	for !a.endIfIdle() {
		if time.Since(lastSweep) >= leaveSweep {
			a.closeIdleHTTP()
			lastSweep = time.Now()
		}
		select {
		case <-a.sess.Done():
			return
		case <-over.C:
			n.log().Warn("leaving agent still has connections past its grace; ending its session",
				zap.String("agent", a.agentID), zap.Int("open_connections", a.sess.NumConns()), zap.Duration("grace", grace))
			a.endMu.Lock()
			a.ended = true
			a.endMu.Unlock()
			a.sess.CloseWithError(errLeaveGraceOver)
			return
		case <-tick.C:
		}
	}
	// The answer to its Drain first (closing drops what is queued): the
	// agent reads it as its routes withdrawn, and the end as a clean leave.
	ctx, cancel := context.WithTimeout(context.Background(), leaveMargin)
	a.sess.Flush(ctx)
	cancel()
	a.sess.CloseWithError(errAgentLeft)
}

// endIfIdle marks a session ended if no connection is open on it or being
// opened, and reports whether it did.
func (a *agentSession) endIfIdle() bool {
	a.endMu.Lock()
	defer a.endMu.Unlock()
	if a.opening.Load() == 0 && a.sess.NumConns() == 0 {
		a.ended = true
	}
	return a.ended
}

// startOpen counts an open on a, unless a is being ended; the caller
// decrements opening when its open returned (the connection, if any, is
// then counted by the session).
func (a *agentSession) startOpen() bool {
	a.endMu.Lock()
	defer a.endMu.Unlock()
	if a.ended {
		return false
	}
	a.opening.Add(1)
	return true
}

// names lists the route names for a log line: the first maxLoggedRoutes,
// then how many more.
func names(es []*routeEntry) []string {
	out := make([]string, 0, min(len(es), maxLoggedRoutes+1))
	for i, e := range es {
		if i == maxLoggedRoutes {
			out = append(out, fmt.Sprintf("(%d more)", len(es)-i))
			break
		}
		out = append(out, routeName(e.route))
	}
	return out
}

// What an agent may put in the node's log lines is bounded: its id
// (ident.CheckID, as the agent itself enforces), its build string, the
// routes listed, the text of its Error frames.
const (
	maxBuildLength   = 256
	maxLoggedRoutes  = 32
	maxLoggedMessage = 256
)

// truncate shortens s to at most n bytes, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return cutUTF8(s, n) + "…"
}

// cutUTF8 returns the longest prefix of s of at most n bytes that does not
// split a UTF-8 character: strings the node sends go into proto string
// fields, which must stay valid UTF-8 (a frame that does not marshal ends
// the session).
func cutUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// admit validates an agent's routes and claims the ports of its listen-port
// routes. Routes it cannot take are returned as rejected, with the reason.
func (n *node) admit(a *agentSession, routes []*tunnelpb.Route, previous []*routeEntry) ([]*routeEntry, []*tunnelpb.RejectedRoute) {
	entries, rejected := validateRoutes(routes)
	entries, overBudget := n.reg.bind(a, entries, previous)
	rejected = append(rejected, overBudget...)
	opts := n.opts.Load()
	kept := entries[:0]
	for _, e := range entries {
		if e.route.GetListenPort() == 0 {
			kept = append(kept, e)
			continue
		}
		if err := n.ports.claim(e, opts); err != nil && !errors.Is(err, errNotBound) {
			rejected = append(rejected, &tunnelpb.RejectedRoute{Name: routeName(e.route), ListenPort: e.route.GetListenPort(), Reason: err.Error()})
			if ok, suppressed := n.portLog.Allow(); ok {
				n.log().Warn("agent port route rejected", zap.String("agent", a.agentID), zap.Uint32("port", e.route.GetListenPort()),
					zap.Error(err), zap.Int("suppressed_since_last", suppressed))
			}
			continue
		}
		kept = append(kept, e)
	}
	return kept, rejected
}

// readmitLocked replaces a registered session's routes with routes (a
// repeated Advertise, or its last one again after a reload changed the port
// options) and answers with a fresh AdvertiseAck. The agent retries what
// is rejected with its backoff. Callers hold admitMu.
func (n *node) readmitLocked(a *agentSession, routes []*tunnelpb.Route) {
	select {
	case <-a.sess.Done():
		// An Advertise dispatched as the session ended: its end released
		// the ports and routes already (under admitMu), and claiming them
		// again would bind ports to a dead session for good.
		return
	default:
	}
	if a.leaving.Load() {
		// The agent is shutting down (leave): its routes stay withdrawn,
		// also when a reload re-admits the port routes of every session.
		return
	}
	a.advertised = routes
	old := a.currentRoutes(&n.reg.mu)
	entries, rejected := n.admit(a, routes, old)
	n.reg.reroute(a, entries)
	n.releasePorts(old) // after the new claims, so a re-claimed port stays bound
	n.sendAck(a, rejected)
}

// applyPortOptions re-admits the listen-port routes when the port options
// changed from old to new in a way that matters: a different range, or a
// different tcp_bind while a range is set (without one nothing is bound).
func (n *node) applyPortOptions(old, new *nodeOptions) {
	rangeChanged := old.portRange != new.portRange
	rebind := old.tcpBind != new.tcpBind && (old.portRange.lo != 0 || new.portRange.lo != 0)
	if rangeChanged || rebind {
		n.portOptionsChanged(rebind)
	}
}

// portOptionsChanged re-admits the listen-port routes of every session
// after a reload changed tcp_port_range or tcp_bind: ports the new range
// excludes are released (connections already relayed keep running) and
// reported rejected to their agents, ports it now includes are bound at
// once, and a new tcp_bind rebinds every port. Sessions without
// listen-port routes are left alone, their pooled connections with them.
func (n *node) portOptionsChanged(rebind bool) {
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	sessions := n.reg.sessions()
	if rebind {
		n.ports.closeAll()
		// Largest agent id first: a port's smaller ids then join the
		// claim as its owner, and the larger ones stay as standbys (a
		// claim refuses a larger id only once a smaller one holds it).
		slices.SortFunc(sessions, func(x, y *agentSession) int { return strings.Compare(y.agentID, x.agentID) })
	}
	readmitted := 0
	for _, a := range sessions {
		if slices.ContainsFunc(a.advertised, func(r *tunnelpb.Route) bool { return r.GetListenPort() != 0 }) {
			n.readmitLocked(a, a.advertised)
			readmitted++
		}
	}
	if readmitted > 0 {
		n.log().Info("port options changed; agent port routes re-admitted", zap.Int("sessions", readmitted))
	}
}

// releasePorts gives up the port claims of routes.
func (n *node) releasePorts(routes []*routeEntry) {
	for _, e := range routes {
		if e.route.GetListenPort() != 0 {
			n.ports.release(e)
		}
	}
}

// admitStream counts a stream that has not advertised yet against
// max_pending_streams (and per address).
func (n *node) admitStream(remote string, opts *nodeOptions) (func(), error) {
	rel, ok := n.pending.acquire(opts.maxPending)
	if !ok {
		return nil, status.Errorf(codes.ResourceExhausted, "too many agent streams awaiting Advertise (max_pending_streams %d)", opts.maxPending)
	}
	relAddr, ok := n.pendingByAddr.acquire(remote, opts.maxPendingPerAddr)
	if !ok {
		rel()
		return nil, status.Errorf(codes.ResourceExhausted, "too many agent streams awaiting Advertise from %s (max_pending_streams_per_address %d)", addrHost(remote), opts.maxPendingPerAddr)
	}
	return func() { relAddr(); rel() }, nil
}

// admitSession counts a session against max_sessions (and per address). An
// agent replacing its own session, or succeeding its one leaving session
// (registry.succeeds), is always admitted.
func (n *node) admitSession(remote, agentID string, opts *nodeOptions) (func(), error) {
	replacing := n.reg.succeeds(agentID)
	limit, perAddr := opts.maxSessions, opts.maxSessionsPerAddr
	if replacing {
		limit, perAddr = 0, 0
	}
	rel, ok := n.sessions.acquire(limit)
	if !ok {
		return nil, status.Errorf(codes.ResourceExhausted, "node has its maximum of %d agent sessions (max_sessions)", limit)
	}
	relAddr, ok := n.sessionsByAddr.acquire(remote, perAddr)
	if !ok {
		rel()
		return nil, status.Errorf(codes.ResourceExhausted, "%s has its maximum of %d agent sessions (max_sessions_per_address)", addrHost(remote), perAddr)
	}
	return func() { relAddr(); rel() }, nil
}

// logStream logs a refused stream through a throttle: a flood logs a few
// lines and then one line with the count suppressed.
func (n *node) logStream(msg, remote string, err error) {
	if ok, suppressed := n.streamLog.Allow(); ok {
		n.log().Warn(msg, zap.String("remote", remote), zap.Error(err), zap.Int("suppressed_since_last", suppressed))
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

// drain stops new tunnel streams and port connections, tells the agents,
// and waits (up to drain_grace) for open virtual connections to finish.
func (n *node) drain() {
	n.admitMu.Lock() // see Connect: no session registers past this unseen
	n.draining.Store(true)
	sessions := n.reg.sessions()
	n.admitMu.Unlock()
	n.drainNow()
	n.ports.closeAll()
	n.closeIdleConns() // idle pooled connections are not in flight: do not wait for them
	grace := n.opts.Load().drainGrace
	for _, a := range sessions {
		a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{
			GraceMs: uint32(grace / time.Millisecond), Reason: "node shutting down",
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

// refuseAgentOpened answers every connection an agent opens (the protocol
// gives agents no use for them) so none waits in the backlog holding a slot.
func refuseAgentOpened(ctx context.Context, sess *tunnelcore.Session) {
	for {
		c, err := sess.Accept(ctx)
		if err != nil {
			return
		}
		c.Abort(tunnelpb.Error_REFUSED, "nodes accept no connections from agents")
	}
}
