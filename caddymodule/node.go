package caddymodule

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
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
	budget   *tunnelcore.Budget
	id       string

	logger atomic.Pointer[zap.Logger]
	token  atomic.Pointer[string]
	opts   atomic.Pointer[nodeOptions]

	mu        sync.Mutex
	onSession map[any]func() // called when a session ends (transports close idle conns)

	serveDone chan struct{}
}

// nodeOptions are the settings the current config gives the node.
type nodeOptions struct {
	advertiseTimeout    time.Duration
	portRange           portRange     // ports agents may claim; zero: the node binds none
	tcpBind             string        // host the claimed ports bind on ("" = all)
	verbatimIdleTimeout time.Duration // default idle bound of relayed TCP connections; 0 = off
}

// nodeKey identifies a node in the pool.
type nodeKey string

func newNode(addr string, ln net.Listener, creds credentials.TransportCredentials, logger *zap.Logger) *node {
	n := &node{
		addr:      addr,
		listener:  ln,
		reg:       newRegistry(),
		budget:    tunnelcore.NewBudget(tunnelcore.DefaultBudget),
		id:        ln.Addr().String(),
		onSession: map[any]func(){},
		serveDone: make(chan struct{}),
	}
	n.ports = newPortManager(n)
	n.logger.Store(logger)
	n.opts.Store(&nodeOptions{advertiseTimeout: 10 * time.Second})
	opts := []grpc.ServerOption{
		grpc.ForceServerCodecV2(tunnelpb.Codec{}),
		experimental.BufferPool(tunnelcore.BufferPool()),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		// Agents ping every 30 s even with no stream open; allow down to 10 s.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	n.server = grpc.NewServer(opts...)
	tunnelpb.RegisterTunnelServer(n.server, &tunnelService{n: n})
	go func() {
		defer close(n.serveDone)
		if err := n.server.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log().Error("sluice control plane stopped serving", zap.String("listen", addr), zap.Error(err))
		}
	}()
	return n
}

func (n *node) log() *zap.Logger { return n.logger.Load() }

// Destruct implements caddy.Destructor: the last config using this control
// address was unloaded.
func (n *node) Destruct() error {
	for _, a := range n.reg.sessions() {
		a.sess.CloseWithError(errors.New("sluice node shut down"))
	}
	n.ports.closeAll()
	n.server.Stop()
	<-n.serveDone
	n.log().Info("sluice control plane closed", zap.String("listen", n.addr))
	return nil
}

// watchSessions registers fn to run whenever an agent session ends.
func (n *node) watchSessions(key any, fn func()) {
	n.mu.Lock()
	n.onSession[key] = fn
	n.mu.Unlock()
}

func (n *node) unwatchSessions(key any) {
	n.mu.Lock()
	delete(n.onSession, key)
	n.mu.Unlock()
}

func (n *node) sessionEnded() {
	n.mu.Lock()
	fns := make([]func(), 0, len(n.onSession))
	for _, fn := range n.onSession {
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

// ListNodes returns this node; a cluster's membership comes later.
func (s *tunnelService) ListNodes(ctx context.Context, _ *tunnelpb.ListNodesRequest) (*tunnelpb.NodeList, error) {
	if err := s.n.authorize(ctx); err != nil {
		return nil, err
	}
	return &tunnelpb.NodeList{Nodes: []*tunnelpb.Node{{Id: s.n.id}}}, nil
}

// authorize checks the bearer token in constant time.
func (n *node) authorize(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	var got string
	if v := md.Get("authorization"); len(v) > 0 {
		if t, ok := strings.CutPrefix(v[0], "Bearer "); ok {
			got = t
		}
	}
	want := n.token.Load()
	if want == nil || *want == "" || got == "" ||
		subtle.ConstantTimeCompare([]byte(got), []byte(*want)) != 1 {
		return status.Error(codes.Unauthenticated, "invalid or missing token")
	}
	return nil
}

// Connect serves one agent stream: authorize, read the Advertise, register
// the session, answer with AdvertiseAck, and keep it until the stream ends.
func (s *tunnelService) Connect(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	n := s.n
	ctx := stream.Context()
	remote := "unknown"
	if p, ok := peer.FromContext(ctx); ok {
		remote = p.Addr.String()
	}
	if err := n.authorize(ctx); err != nil {
		n.log().Warn("agent rejected", zap.String("remote", remote), zap.String("reason", "invalid token"))
		return err
	}
	adv, err := n.readAdvertise(stream)
	if err != nil {
		n.log().Warn("agent rejected", zap.String("remote", remote), zap.Error(err))
		return err
	}
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("x-sluice-id")) > 0 && md.Get("x-sluice-id")[0] != adv.GetAgentId() {
		return status.Errorf(codes.InvalidArgument, "x-sluice-id %q does not match the advertised agent id %q", md.Get("x-sluice-id")[0], adv.GetAgentId())
	}

	streamCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	a := &agentSession{agentID: adv.GetAgentId(), remote: remote, build: adv.GetBuild(), connected: time.Now()}
	sess, err := tunnelcore.NewSession(tunnelcore.GRPCStream(stream, cancel), tunnelcore.Config{
		Role:       tunnelcore.RoleNode,
		PeerWindow: adv.GetInitialWindow(),
		Budget:     n.budget,
		Logger:     n.log().With(zap.String("agent", a.agentID)),
		OnControl:  func(f *tunnelpb.Frame) { n.onControl(a, f) },
	})
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	a.sess = sess
	entries, rejected := n.admit(a, adv.GetRoutes())
	if old := n.reg.register(a, entries); old != nil {
		n.log().Info("agent session replaced by a newer stream", zap.String("agent", a.agentID),
			zap.String("old_remote", old.remote), zap.String("remote", remote))
	}
	n.sendAck(a, rejected)
	n.log().Info("agent connected", zap.String("agent", a.agentID), zap.String("remote", remote),
		zap.String("build", a.build), zap.Strings("routes", names(entries)), zap.Int("rejected", len(rejected)))

	select {
	case <-sess.Done():
	case <-streamCtx.Done():
		sess.CloseWithError(context.Cause(streamCtx))
	}
	if n.reg.unregister(a) {
		n.log().Info("agent disconnected", zap.String("agent", a.agentID), zap.String("remote", remote),
			zap.NamedError("reason", sess.Err()))
	}
	n.releasePorts(a.currentRoutes(&n.reg.mu))
	n.sessionEnded()
	return nil
}

// readAdvertise waits for the agent's first frame, which must be Advertise.
func (n *node) readAdvertise(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) (*tunnelpb.Advertise, error) {
	type result struct {
		env *tunnelpb.Envelope
		err error
	}
	ch := make(chan result, 1)
	go func() {
		env := &tunnelpb.Envelope{}
		err := stream.RecvMsg(env)
		ch <- result{env, err}
	}()
	timeout := n.opts.Load().advertiseTimeout
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var r result
	select {
	case r = <-ch:
	case <-timer.C:
		return nil, status.Errorf(codes.DeadlineExceeded, "no Advertise within %v", timeout)
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.env.IsData() {
		r.env.Payload.Free()
		return nil, status.Error(codes.FailedPrecondition, "first frame must be Advertise, got Data")
	}
	adv := r.env.Frame.GetAdvertise()
	switch {
	case adv == nil:
		return nil, status.Errorf(codes.FailedPrecondition, "first frame must be Advertise, got %T", r.env.Frame.GetKind())
	case adv.GetAgentId() == "":
		return nil, status.Error(codes.InvalidArgument, "Advertise.agent_id is empty")
	case adv.GetInitialWindow() < tunnelcore.InitialWindow:
		return nil, status.Errorf(codes.FailedPrecondition, "Advertise.initial_window %d below %d: agent too old", adv.GetInitialWindow(), tunnelcore.InitialWindow)
	}
	return adv, nil
}

func (n *node) sendAck(a *agentSession, rejected []*tunnelpb.RejectedRoute) {
	ack := &tunnelpb.AdvertiseAck{NodeId: n.id, InitialWindow: tunnelcore.InitialWindow, Rejected: rejected}
	for _, e := range a.routes {
		ack.Accepted = append(ack.Accepted, &tunnelpb.RouteKey{Name: routeName(e.route)})
	}
	a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}})
}

// onControl handles session frames after the handshake. A repeated
// Advertise replaces the agent's routes.
func (n *node) onControl(a *agentSession, f *tunnelpb.Frame) {
	switch k := f.GetKind().(type) {
	case *tunnelpb.Frame_Advertise:
		old := a.currentRoutes(&n.reg.mu)
		entries, rejected := n.admit(a, k.Advertise.GetRoutes())
		n.reg.reroute(a, entries)
		n.releasePorts(old) // after the new claims, so a re-claimed port stays bound
		n.sendAck(a, rejected)
	case *tunnelpb.Frame_Error:
		n.log().Warn("agent reported an error", zap.String("agent", a.agentID), zap.String("message", k.Error.GetMessage()))
	default:
		n.log().Debug("ignoring frame from agent", zap.String("agent", a.agentID), zap.String("frame", fmt.Sprintf("%T", k)))
	}
}

func names(es []*routeEntry) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = routeName(e.route)
	}
	return out
}

// admit validates an agent's routes and claims the ports of its listen-port
// routes. Routes it cannot take are returned as rejected, with the reason.
func (n *node) admit(a *agentSession, routes []*tunnelpb.Route) ([]*routeEntry, []*tunnelpb.RejectedRoute) {
	entries, rejected := validateRoutes(routes)
	opts := n.opts.Load()
	kept := entries[:0]
	for _, e := range entries {
		e.agent = a
		if e.route.GetListenPort() == 0 {
			kept = append(kept, e)
			continue
		}
		if err := n.ports.claim(e, opts); err != nil && !errors.Is(err, errNotBound) {
			rejected = append(rejected, &tunnelpb.RejectedRoute{Name: routeName(e.route), ListenPort: e.route.GetListenPort(), Reason: err.Error()})
			n.log().Warn("agent port route rejected", zap.String("agent", a.agentID), zap.Uint32("port", e.route.GetListenPort()), zap.Error(err))
			continue
		}
		kept = append(kept, e)
	}
	return kept, rejected
}

// releasePorts gives up the port claims of routes.
func (n *node) releasePorts(routes []*routeEntry) {
	for _, e := range routes {
		if e.route.GetListenPort() != 0 {
			n.ports.release(e)
		}
	}
}
