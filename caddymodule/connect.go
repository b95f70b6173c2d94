package caddymodule

import (
	"context"
	"errors"
	"net"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/ident"
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

// tunnelService implements the Tunnel gRPC service.
type tunnelService struct {
	tunnelpb.UnimplementedTunnelServer
	n *node
}

// ListNodes returns the cluster's members, or this node alone (its node_id
// and an empty url) without a cluster. Its caller authenticated in the tap
// (tapAuthenticate).
func (s *tunnelService) ListNodes(ctx context.Context, _ *tunnelpb.ListNodesRequest) (*tunnelpb.NodeList, error) {
	if _, err := authenticated(ctx); err != nil {
		return nil, err
	}
	return &tunnelpb.NodeList{Nodes: s.n.members()}, nil
}

// Connect serves one agent stream through the stages of a session on the
// node, each a method of handshake below:
//
//	authenticate  the tap checked the token on the stream's headers (tapAuthenticate)
//	admit         count the stream, offer a data lane, read the Advertise, count the session
//	negotiate     run the session on the gRPC stream or on the lane the agent attached
//	register      admit its routes, replace an older session of its id, answer AdvertiseAck
//	serve         until the stream or the session ends
//	unregister    withdraw its routes and ports, and map how it ended to the stream's status
func (s *tunnelService) Connect(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	h, err := s.n.authenticated(stream)
	if err != nil {
		return err
	}
	defer h.release()
	if err := h.admit(); err != nil {
		return err
	}
	if err := h.negotiateAndRegister(); err != nil {
		return err
	}
	h.serve()
	return h.unregister()
}

// handshake is one agent stream on its way through Connect's stages.
type handshake struct {
	n        *node
	stream   grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]
	remote   string
	progress func() uint64 // the connection's delivered bytes, for the stall watchdog; nil: none
	auth     authn         // how the stream authenticated
	opts     *nodeOptions  // as the stream found them

	op        opening // the Advertise, and the lane if the agent attached one
	directKey string  // the key the session's direct sockets present; "": none offered
	// streamCtx ends with the stream, or when the node ends it (cancel).
	streamCtx context.Context
	cancel    context.CancelFunc
	a         *agentSession
	// sessionRan: a session ran on the lane, which closeLane then lets
	// drain before it closes it.
	sessionRan bool
	deferred   []func() // run by release, last first
}

// authenticated starts the handshake of a stream the tap let through.
func (n *node) authenticated(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) (*handshake, error) {
	ctx := stream.Context()
	h := &handshake{n: n, stream: stream, remote: "unknown", opts: n.opts.Load()}
	if p, ok := peer.FromContext(ctx); ok {
		h.remote = p.Addr.String()
		h.progress = tunnelcore.ProgressOf(p.AuthInfo)
	}
	if n.draining.Load() {
		n.metrics.refuseStream(refusedDraining)
		return nil, status.Error(codes.Unavailable, errDrainingNode.Error())
	}
	au, err := authenticated(ctx)
	if err != nil {
		return nil, err
	}
	h.auth = au
	h.streamCtx, h.cancel = context.WithCancel(ctx)
	h.onRelease(h.cancel)
	return h, nil
}

// onRelease registers fn for release.
func (h *handshake) onRelease(fn func()) { h.deferred = append(h.deferred, fn) }

// release undoes what the stages took, last first.
func (h *handshake) release() {
	for i := len(h.deferred) - 1; i >= 0; i-- {
		h.deferred[i]()
	}
}

// admit counts the stream against max_pending_streams while it offers a
// data lane and waits for the Advertise, then counts the session against
// max_sessions, and checks the id the stream's header announced.
func (h *handshake) admit() error {
	n := h.n
	releasePending, err := n.admitStream(h.remote, h.opts)
	if err != nil {
		n.logStream("agent stream refused", h.remote, err)
		return err
	}
	offered := time.Now()
	lanes, directKey, withdrawLane := n.offerLane(h.stream)
	op, err := n.readAdvertise(h.stream, lanes)
	if op.lane != nil {
		op.laneAfter = op.laneAt.Sub(offered)
	}
	withdrawLane()
	releasePending()
	if err != nil {
		n.logStream("agent rejected", h.remote, err)
		return err
	}
	h.op, h.directKey = op, directKey
	if op.lane != nil {
		// Closed when the handler returns, whichever way: unused when the
		// stream is refused, else after the session's last frames (see
		// closeLane).
		h.onRelease(func() { closeLane(op.frames, h.sessionRan) })
	}
	releaseSession, err := n.admitSession(h.remote, agentKey{h.auth.cred.name, op.adv.GetAgentId()}, h.auth.cred.scope, h.opts)
	if err != nil {
		n.logStream("agent session refused", h.remote, err)
		return err
	}
	h.onRelease(releaseSession)
	md, _ := metadata.FromIncomingContext(h.stream.Context())
	if ids := md.Get("x-sluice-id"); len(ids) > 0 && ids[0] != op.adv.GetAgentId() {
		n.metrics.refuseStream(refusedInvalidAdvertise)
		return status.Errorf(codes.InvalidArgument, "x-sluice-id %q does not match the advertised agent id %q", ids[0], op.adv.GetAgentId())
	}
	return nil
}

// negotiateAndRegister starts the session and registers it under admitMu,
// taken before the session's receive loop starts: a second Advertise
// waits until the first is admitted and registered.
func (h *handshake) negotiateAndRegister() error {
	n := h.n
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	if err := h.stillAdmissible(); err != nil {
		return err
	}
	if err := h.negotiate(); err != nil {
		return err
	}
	h.register()
	return nil
}

// stillAdmissible refuses a stream whose agent gave up on it (its context
// ended) while it waited for admitMu, and one that waited for its
// Advertise while a reload changed its credential (a stream that would no longer
// authenticate must not displace the agent's current session), or while the node started
// draining (drain lists the sessions to tell under admitMu: a session
// registered after that would serve on a node going away without its
// Drain). Callers hold admitMu.
func (h *handshake) stillAdmissible() error {
	n := h.n
	if err := h.streamCtx.Err(); err != nil {
		// The agent gave up while the stream waited for admitMu (its ack
		// timeout passed) and is retrying on a new one: registering this
		// one would admit routes and count a session for no one, and under
		// a queue of admissions those dead sessions pile up.
		n.metrics.refuseStream(refusedStreamEnded)
		return status.FromContextError(err).Err()
	}
	set := n.creds.Load()
	if !set.stillValid(h.auth) {
		n.metrics.refuseStream(refusedCredentialChanged)
		err := status.Error(codes.Unauthenticated, "the node's credentials changed while the stream waited for its Advertise")
		n.logStream("agent rejected", h.remote, err)
		return err
	}
	// Still valid, but a reload may have given the credential another
	// scope since the tap found it: admit the routes under the current one
	// (applyCredentials re-scoped only the sessions registered then).
	h.auth.cred = set.byName[h.auth.cred.name]
	if n.draining.Load() {
		n.metrics.refuseStream(refusedDraining)
		return status.Error(codes.Unavailable, errDrainingNode.Error())
	}
	return nil
}

// negotiate starts the session on the transport the agent chose: the data
// lane it attached, else the gRPC stream. Callers hold admitMu.
func (h *handshake) negotiate() error {
	n, adv := h.n, h.op.adv
	a := &agentSession{agentID: adv.GetAgentId(), remote: h.remote, build: adv.GetBuild(), connected: time.Now(), auth: h.auth, credName: h.auth.cred.name,
		lane: h.op.lane != nil, idValue: adv.GetAgentId()}
	frames := tunnelcore.GRPCStream(h.stream, h.cancel)
	progress := h.progress
	if h.op.lane != nil {
		frames = &laneStream{LaneStream: h.op.frames, endGRPC: h.cancel}
		progress = tunnelcore.ConnProgress(h.op.lane)
	}
	h.progress = progress
	sess, err := tunnelcore.NewSession(frames, tunnelcore.Config{
		Role:         tunnelcore.RoleNode,
		PeerWindow:   adv.GetInitialWindow(),
		Budget:       n.budget,
		Slots:        n.slots,
		StallTimeout: h.opts.stallTimeout,
		Progress:     progress,
		Logger:       n.log().With(zap.String("agent", a.agentID)),
		OnControl:    func(f *tunnelpb.Frame) { n.onControl(a, f) },
		OnConnEnd:    func(e tunnelcore.ConnEnd) { n.connEnded(a, e) },
		Counters:     &n.metrics.tunnel,
		// The protocol gives agents no use for opening connections:
		// refused in the receive loop, no backlog or goroutine for them.
		RefuseOpens: "nodes accept no connections from agents",
	})
	if err != nil {
		frames.Close(err)
		return status.Error(codes.Internal, err.Error())
	}
	if h.op.lane != nil {
		h.sessionRan = true
		sess.SeedRoundTrip(h.op.laneAfter)
		go endWithGRPCStream(sess, h.op.grpcRecv)
		if h.directKey != "" {
			n.direct.register(h.directKey, sess)
			key := h.directKey
			h.onRelease(func() { n.direct.forget(key) })
		}
	}
	a.sess = sess
	a.advertised = adv.GetRoutes()
	h.a = a
	return nil
}

// register admits the session's routes and claims its ports, makes it its
// agent id's session (ending the one it replaces), and answers the
// Advertise. Callers hold admitMu.
func (h *handshake) register() {
	n, a := h.n, h.a
	entries, rejected := n.admit(a, a.advertised, nil)
	var oldRoutes []*routeEntry
	if old := n.reg.register(a, entries); old != nil {
		a.displaced = true
		// The displaced session ends now: left open, it would hold its
		// place in max_sessions while serving nothing (and a client
		// reusing one id could open any number of them).
		old.sess.CloseWithError(errReplaced)
		n.logReplaced(old, a)
		oldRoutes = old.currentRoutes(&n.reg.mu)
	}
	n.sendAck(a, rejected)
	// The members follow the ack, and from then on each change of them
	// (pushMembership): an agent learns of the other nodes only once this
	// one admitted it.
	n.sendMembershipLocked(a, n.opts.Load())
	n.noticeOverlapsLocked(a, entries, oldRoutes)
	h.logConnected(entries, len(rejected))
}

// logReplaced logs that a's stream replaced old, at WARN when old had
// itself replaced a session moments before (two agents with one id).
func (n *node) logReplaced(old, a *agentSession) {
	ok, suppressed := n.sessionLog.Allow()
	if !ok {
		return
	}
	fields := []zap.Field{zap.String("agent", a.agentID), zap.String("old_remote", old.remote),
		zap.String("remote", a.remote), zap.Int("suppressed_since_last", suppressed)}
	if lived := time.Since(old.connected); old.displaced && lived < idClashWindow {
		n.log().Warn(msgIDClash, append(fields, zap.Duration("replaced_after", lived.Round(time.Millisecond)))...)
	} else {
		n.log().Info("agent session replaced by a newer stream", fields...)
	}
}

// logConnected logs the registered session. stall_progress: whether the
// stall watchdog reads the connection's progress (else it times blocked
// sends alone; see tunnelcore).
func (h *handshake) logConnected(entries []*routeEntry, rejected int) {
	ok, suppressed := h.n.sessionLog.Allow()
	if !ok {
		return
	}
	h.n.log().Info("agent connected", zap.String("agent", h.a.agentID), zap.String("remote", h.remote),
		zap.String("build", h.a.build), zap.Strings("routes", names(entries)), zap.Int("rejected", rejected),
		zap.Bool("data_lane", h.op.lane != nil), zap.Bool("direct_sockets", h.op.lane != nil && h.directKey != ""),
		zap.Bool("stall_progress", h.progress != nil),
		zap.Int("suppressed_since_last", suppressed))
}

// serve keeps the session until it or the stream ends.
func (h *handshake) serve() {
	sess := h.a.sess
	// A reload may have changed the credentials since this stream's was
	// checked (it waited for its Advertise meanwhile): the reload's sweep
	// of old sessions ran before this one was registered.
	if !h.n.creds.Load().stillValid(h.auth) {
		sess.CloseWithError(errCredentialChanged)
	}
	select {
	case <-sess.Done():
	case <-h.streamCtx.Done():
		sess.CloseWithError(context.Cause(h.streamCtx))
	}
}

// unregister withdraws the ended session's routes and ports and returns
// the stream's status. Its pooled virtual connections failed with the
// session, and their dial addresses left the route table: net/http drops
// them itself. The other agents' pools are left alone.
func (h *handshake) unregister() error {
	n, a, sess := h.n, h.a, h.a.sess
	// Under admitMu, so a re-admission of this session (a reload changing
	// the port options) cannot claim ports after they were released here.
	n.admitMu.Lock()
	unregistered := n.reg.unregister(a)
	n.releasePorts(a.currentRoutes(&n.reg.mu))
	if unregistered {
		n.noticeOverlapsLocked(a, a.currentRoutes(&n.reg.mu))
	}
	n.admitMu.Unlock()
	if errors.Is(sess.Err(), tunnelcore.ErrStalled) {
		n.metrics.stalls.Add(1)
	}
	if unregistered {
		if ok, suppressed := n.sessionLog.Allow(); ok {
			n.log().Info("agent disconnected", zap.String("agent", a.agentID), zap.String("remote", h.remote),
				zap.NamedError("reason", sess.Err()), zap.Int("suppressed_since_last", suppressed))
		}
	}
	return sessionStatus(a.agentID, sess.Err())
}

// sessionStatus is the stream status of a session that ended with err.
func sessionStatus(agentID string, err error) error {
	switch {
	case errors.Is(err, errReplaced):
		return status.Errorf(codes.Aborted, "%v (agent id %q)", errReplaced, agentID)
	case errors.Is(err, errCredentialChanged):
		return status.Error(codes.Unauthenticated, errCredentialChanged.Error())
	case errors.Is(err, errLeaveGraceOver):
		return status.Error(codes.DeadlineExceeded, errLeaveGraceOver.Error())
	}
	return nil
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
	// laneAt is when the lane attached; laneAfter how long after the
	// offer went out, at least one round trip to the agent (the offer's
	// way there, the lane's hello back): the session's first estimate of
	// its round trip (Session.SeedRoundTrip).
	laneAt    time.Time
	laneAfter time.Duration
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
		op = opening{lane: conn, frames: tunnelcore.ConnStream(conn), grpcRecv: ch, laneAt: time.Now()}
		r = readLaneAdvertise(conn, op.frames, ch, timer.C, draining)
	case <-timer.C:
		r.err = errNoAdvertise
	case <-draining:
		r.err = errDrainingNode
	}
	var err error
	switch {
	case errors.Is(r.err, errNoAdvertise):
		n.metrics.advertiseTimeouts.Add(1)
		n.metrics.refuseStream(refusedAdvertiseTimeout)
		err = status.Errorf(codes.DeadlineExceeded, "no Advertise within %v", timeout)
	case errors.Is(r.err, errDrainingNode):
		n.metrics.refuseStream(refusedDraining)
		err = status.Error(codes.Unavailable, errDrainingNode.Error())
	default:
		op.adv, err = checkAdvertise(r)
		if err != nil && r.err == nil {
			n.metrics.refuseStream(refusedInvalidAdvertise) // not a stream that ended before it advertised
		}
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
// session's Drain with none, and tells which of them agents of other
// credentials serve too. Callers hold admitMu.
func (n *node) sendAck(a *agentSession, rejected []*tunnelpb.RejectedRoute) {
	// Build names the node to the agent, which logs it on connect.
	ack := &tunnelpb.AdvertiseAck{NodeId: n.ackNodeID(n.opts.Load()), InitialWindow: tunnelcore.InitialWindow, Rejected: rejected,
		Build: tunnelpb.Build("sluice-node", ""), Credential: a.credName}
	if !a.leaving.Load() {
		routes := a.currentRoutes(&n.reg.mu)
		for _, e := range routes {
			ack.Accepted = append(ack.Accepted, &tunnelpb.RouteKey{Name: routeName(e.route)})
		}
		ack.Overlaps = overlapsOf(n.reg.table.Load(), a)
	}
	before := a.overlaps
	a.rejected, a.overlaps = rejected, overlapsKey(ack.Overlaps)
	n.logShadowed(a, ack.Overlaps, before)
	a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}})
}

// admitStream counts a stream that has not advertised yet against
// max_pending_streams (and per address).
func (n *node) admitStream(remote string, opts *nodeOptions) (func(), error) {
	rel, ok := n.pending.acquire(opts.maxPending)
	if !ok {
		n.metrics.refuseStream(refusedPending)
		return nil, status.Errorf(codes.ResourceExhausted, "too many agent streams awaiting Advertise (max_pending_streams %d)", opts.maxPending)
	}
	relAddr, ok := n.pendingByAddr.acquire(remote, opts.maxPendingPerAddr)
	if !ok {
		rel()
		n.metrics.refuseStream(refusedPendingPerAddr)
		return nil, status.Errorf(codes.ResourceExhausted, "too many agent streams awaiting Advertise from %s (max_pending_streams_per_address %d)", addrHost(remote), opts.maxPendingPerAddr)
	}
	return func() { relAddr(); rel() }, nil
}

// admitSession counts a session against max_sessions (and per address,
// and per credential). An agent replacing its own session, or succeeding
// its one leaving session (registry.succeeds), is always admitted.
func (n *node) admitSession(remote string, key agentKey, sc *scope, opts *nodeOptions) (func(), error) {
	replacing := n.reg.succeeds(key)
	limit, perAddr, perCred := opts.maxSessions, opts.maxSessionsPerAddr, 0
	if sc != nil {
		perCred = sc.maxSessions
	}
	if replacing {
		limit, perAddr, perCred = 0, 0, 0
	}
	rel, ok := n.sessions.acquire(limit)
	if !ok {
		n.metrics.refuseStream(refusedSessions)
		return nil, status.Errorf(codes.ResourceExhausted, "node has its maximum of %d agent sessions (max_sessions)", limit)
	}
	relAddr, ok := n.sessionsByAddr.acquire(remote, perAddr)
	if !ok {
		rel()
		n.metrics.refuseStream(refusedSessionsPerAddr)
		return nil, status.Errorf(codes.ResourceExhausted, "%s has its maximum of %d agent sessions (max_sessions_per_address)", addrHost(remote), perAddr)
	}
	relCred, ok := n.sessionsByCred.acquireKey(key.credential, perCred)
	if !ok {
		relAddr()
		rel()
		n.metrics.refuseStream(refusedSessionsPerCredential)
		return nil, status.Errorf(codes.ResourceExhausted, "credential %q has its maximum of %d agent sessions (max_sessions)", key.credential, perCred)
	}
	return func() { relCred(); relAddr(); rel() }, nil
}

// logStream logs a refused stream through a throttle: a flood logs a few
// lines and then one line with the count suppressed.
func (n *node) logStream(msg, remote string, err error) {
	if ok, suppressed := n.streamLog.Allow(); ok {
		n.log().Warn(msg, zap.String("remote", remote), zap.Error(err), zap.Int("suppressed_since_last", suppressed))
	}
}
