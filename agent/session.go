package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// sessionResult is how one session attempt ended.
type sessionResult struct {
	connected bool          // the node acknowledged the Advertise
	drained   bool          // the node sent Drain
	err       error         // why it ended
	uptime    time.Duration // how long it was connected
	// spread is the reconnect spread of the node's Drain (0: none): the
	// link draws its next attempt from [initial/2, spread] (backoff.Spread).
	spread time.Duration
	// standby is the id of the node the attempt reached when another
	// link serves that node already (cluster.claim): the link stands by.
	standby string
}

// sessionAttempt is one session, from the dial to its end, run in stages:
// the handshake (dial, openStream, start on the transport the node's
// header offers, Advertise, awaitAck), then serve, whose loop hands each
// event to a handler of its own. The node's control messages are taken by
// control's handlers on the receive loop.
type sessionAttempt struct {
	a *Agent
	l *link
	// t is where the attempt dials: the link's target, or the server
	// setting when the link falls back to it (link.nextTarget).
	t *linkTarget
	// runCtx is the link's context: its end ends the attempt.
	runCtx context.Context
	// ctx is the attempt's own, ended with it (cancel) or by Leave before
	// the node acknowledged (stopLeaveWatch stops that): it carries the
	// stream and bounds the upstream dials.
	ctx            context.Context
	cancel         context.CancelFunc
	stopLeaveWatch func() bool
	hostport       string
	cc             *grpc.ClientConn
	rs             *recordingStream
	tr             sessionTransport
	sess           *tunnelcore.Session
	ctl            *control
	adv            *tunnelpb.Frame
	// creds are the attempt's transport credentials (attemptCredentials):
	// the gRPC connection, the data lane and the direct sockets use them.
	creds credentials.TransportCredentials
	// undo holds what close undoes, in the order the stages set it up.
	undo []func()

	// Serving: the routes' state, the re-Advertise of rejected routes, the
	// node's Drain deadline and, once the link leaves, the leave.
	routes     *routeState
	readv      *readvertiser
	drainTimer *time.Timer
	lv         *leaving // nil until Leave
}

// session runs one session attempt of the link to t: the handshake, then
// serving until the session ends or ctx is cancelled.
func (l *link) session(ctx context.Context, t *linkTarget) sessionResult {
	s, ack, failed := l.connect(ctx, t)
	defer s.close()
	if failed != nil {
		return *failed
	}
	return s.serve(ack)
}

// connect begins a session attempt of l to t under the link's context ctx
// and runs its handshake (dial, stream, transport, Advertise, the first
// AdvertiseAck). It is the connect path the agent's links (session) and
// Check share, so that a check proves what the agent will do; only what
// follows the ack differs. The caller closes s whatever the outcome;
// failed says why there is no ack.
func (l *link) connect(ctx context.Context, t *linkTarget) (s *sessionAttempt, ack *tunnelpb.AdvertiseAck, failed *sessionResult) {
	s = &sessionAttempt{a: l.a, l: l, t: t, runCtx: ctx}
	ack, failed = s.handshake()
	return s, ack, failed
}

// later registers f for close, which runs it after everything registered
// later (as defer would in one function).
func (s *sessionAttempt) later(f func()) { s.undo = append(s.undo, f) }

// close undoes what the stages set up, last first.
func (s *sessionAttempt) close() {
	for i := len(s.undo) - 1; i >= 0; i-- {
		s.undo[i]()
	}
}

// handshake connects and advertises, and returns the node's first
// AdvertiseAck; failed says why when the attempt ended before it.
func (s *sessionAttempt) handshake() (ack *tunnelpb.AdvertiseAck, failed *sessionResult) {
	fail := func(err error) *sessionResult { return &sessionResult{err: err} }
	if err := s.dial(); err != nil {
		return nil, fail(err)
	}
	if err := s.openStream(); err != nil {
		return nil, fail(err)
	}
	if err := s.start(); err != nil {
		return nil, fail(err)
	}
	s.adv = s.a.advertise()
	if err := s.sess.SendControl(s.adv); err != nil {
		return nil, fail(s.endReason())
	}
	return s.awaitAck()
}

// dial makes the gRPC client connection to the link's node, with the
// client certificate read again for this attempt. It connects lazily: a
// failure to connect shows on the stream.
func (s *sessionAttempt) dial() error {
	t := s.t
	s.hostport = t.hostport
	s.creds = s.a.attemptCredentialsFor(t.serverName)
	opts := s.a.dialOptions(s.creds)
	if t.authority != "" && s.a.nodeTLS == nil {
		// Over TLS gRPC takes the :authority from the server name, which
		// is the server's host already (and refuses another one).
		opts = append(opts, grpc.WithAuthority(t.authority))
	}
	cc, err := grpc.NewClient("dns:///"+s.hostport, opts...)
	if err != nil {
		return err
	}
	s.cc = cc
	s.later(func() { cc.Close() })
	return nil
}

// openStream opens the Connect stream with the agent's token and id; an
// agent without a token (a client certificate alone) sends no
// authorization. Leaving before the node acknowledged gives the attempt up
// at once, also a dial still under way: the leave watch cancels the
// attempt's context.
func (s *sessionAttempt) openStream() error {
	ctx, cancel := context.WithCancel(s.runCtx)
	s.cancel = cancel
	s.later(cancel)
	s.stopLeaveWatch = context.AfterFunc(s.l.leaveReq, cancel)
	s.later(func() { s.stopLeaveWatch() })
	md := []string{"x-sluice-id", s.a.cfg.ID}
	if tok := s.a.token(); tok != "" {
		md = append(md, "authorization", "Bearer "+tok)
	}
	s.ctx = metadata.AppendToOutgoingContext(ctx, md...)
	st, err := tunnelpb.NewTunnelClient(s.cc).Connect(s.ctx)
	if err != nil {
		return err
	}
	s.rs = &recordingStream{BidiStreamingClient: st, recvDone: make(chan struct{})}
	return nil
}

// start runs the tunnelcore session on the transport the node's response
// header offers (a data lane, direct sockets), or on the stream.
func (s *sessionAttempt) start() error {
	s.tr = s.l.sessionFrames(s.ctx, s.creds, s.rs, s.cancel, s.hostport)
	s.ctl = newLinkControl(s.l, s.t)
	sess, err := tunnelcore.NewSession(s.tr.frames, s.coreConfig())
	if err != nil {
		s.tr.frames.Close(err)
		s.cancel()
		return fmt.Errorf("starting the session: %w", err)
	}
	s.sess = sess
	if s.tr.onLane {
		go watchGRPCBesideLane(sess, s.rs)
	}
	s.l.current.Store(sess)
	s.later(func() { s.l.current.Store(nil) })
	s.later(func() { sess.Close() })
	return nil
}

// coreConfig is the configuration of the attempt's tunnelcore session.
func (s *sessionAttempt) coreConfig() tunnelcore.Config {
	return tunnelcore.Config{
		Role:       tunnelcore.RoleAgent,
		OnControl:  s.ctl.dispatch,
		Budget:     s.a.budget,
		Progress:   s.tr.progress,
		DirectDial: s.tr.directDial,
		Counters:   &s.a.tunnel,
		Logger:     s.l.log(),
		// tunnel_stall_timeout: negative is off in both configurations.
		StallTimeout: s.a.cfg.TunnelStallTimeout,
	}
}

// awaitAck waits, at most ackTimeout, for the node's first AdvertiseAck.
func (s *sessionAttempt) awaitAck() (*tunnelpb.AdvertiseAck, *sessionResult) {
	t := time.NewTimer(s.a.ackTimeout)
	defer t.Stop()
	select {
	case <-s.ctl.acks.ready:
		ack := s.ctl.acks.take()
		if !s.stopLeaveWatch() { // Leave came first: the stream is cancelled
			return nil, &sessionResult{err: errLeft}
		}
		return ack, nil
	case <-s.sess.Done():
		return nil, &sessionResult{err: s.endReason(), drained: s.ctl.nodeDrained(), spread: s.ctl.reconnectSpread()}
	case <-s.runCtx.Done():
		return nil, &sessionResult{err: s.runCtx.Err()}
	case <-s.l.leaveReq.Done():
		return nil, &sessionResult{err: errLeft}
	case <-t.C:
		err := fmt.Errorf("no AdvertiseAck within %v", s.a.ackTimeout)
		s.sess.CloseWithError(err)
		return nil, &sessionResult{err: err}
	}
}

// endReason returns why the session ended, preferring the stream's status:
// a client stream's Send reports only io.EOF when the node ended it, and
// the status (Unauthenticated, say) comes from Recv, so it waits up to
// recvErrWait for that.
func (s *sessionAttempt) endReason() error {
	serr := s.sess.Err()
	if code, _ := statusOf(serr); code != codes.Unknown && code != codes.OK {
		return serr
	}
	t := time.NewTimer(recvErrWait)
	defer t.Stop()
	select {
	case <-s.rs.recvDone:
		if code, _ := statusOf(s.rs.recvErr); code != codes.Unknown && code != codes.OK && code != codes.Canceled {
			return s.rs.recvErr
		}
	case <-t.C:
	}
	if serr == nil {
		return errors.New("session ended")
	}
	return serr
}

// serve serves the acknowledged session until it ends or the link's
// context does. A session with a node another link serves already ends at
// once: the link stands by (see link.standBy).
func (s *sessionAttempt) serve(ack *tunnelpb.AdvertiseAck) (res sessionResult) {
	if by := s.a.cluster.claim(s.l, ack.GetNodeId(), s.t); by != "" {
		return sessionResult{standby: ack.GetNodeId(),
			err: fmt.Errorf("node %q is served by the session with %s already", ack.GetNodeId(), by)}
	}
	connectedAt := time.Now()
	defer func() { res.uptime = time.Since(connectedAt) }()
	s.announce(ack)
	defer s.acceptConns()()
	s.readv = newReadvertiser(s.a, s.l.log())
	defer s.readv.stop()
	s.readv.onAck(ack)
	defer s.stopDrainTimer()
	return s.loop()
}

// announce logs the new session and marks the link connected.
func (s *sessionAttempt) announce(ack *tunnelpb.AdvertiseAck) {
	s.routes = newRouteState()
	log := s.l.reached(ack.GetNodeId())
	log.Info("connected",
		zap.String("server", s.t.url),
		zap.String("node_build", cmp.Or(ack.GetBuild(), "unknown (an older node)")),
		zap.String("credential", credentialName(ack.GetCredential())),
		zap.Strings("routes", s.routes.update(log, ack)),
		zap.Bool("data_lane", s.tr.onLane),
		zap.Bool("direct_sockets", s.tr.directDial != nil),
		zap.Bool("stall_progress", s.tr.progress != nil)) // see tunnelcore.Config.Progress
	transport := TransportGRPCStream
	if s.tr.onLane {
		transport = TransportDataLane
	}
	s.l.recordAck(ack)
	s.l.live.connected(ack.GetNodeId(), ack.GetBuild(), transport, s.tr.directDial != nil)
	s.l.markConnected()
}

// acceptConns serves the connections the node opens, in a goroutine, until
// the session ends; wait waits for that goroutine. The upstream dials are
// bounded by the attempt's context, which ends with this session: a dial
// still under way when the session ends would serve a connection that is
// gone, and hold its max_connections slot while the next session's
// connections are refused.
func (s *sessionAttempt) acceptConns() (wait func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := s.sess.Accept(s.runCtx)
			if err != nil {
				return
			}
			s.a.conn.serve(s.ctx, conn)
		}
	}()
	return func() { <-done }
}

// loop hands each event of the serving session to its handler until the
// session ends or the link's context does.
func (s *sessionAttempt) loop() sessionResult {
	leaveC := s.l.leaveReq.Done()
	for {
		select {
		case <-s.runCtx.Done():
			return s.stopped()
		case <-s.sess.Done():
			return s.ended()
		case <-leaveC:
			leaveC = nil // once
			s.leave()
		case <-s.ctl.acks.ready:
			s.onAck()
		case <-s.readv.C():
			s.readvertise()
		case grace := <-s.ctl.drains:
			s.nodeDraining(grace)
		case <-s.drainC():
			s.sess.CloseWithError(errors.New("node drained"))
		}
	}
}

// stopped ends the session as the link's context ended. When leaving,
// that is the end of the grace (link.run ties them): the connections
// still open are cut.
func (s *sessionAttempt) stopped() sessionResult {
	if s.lv != nil {
		s.lv.cut(s.sess)
	}
	return sessionResult{connected: true, err: s.runCtx.Err()}
}

// ended reports the end of the session, and how a leave went.
func (s *sessionAttempt) ended() sessionResult {
	err := s.endReason()
	drained := s.ctl.nodeDrained()
	if s.lv != nil {
		// The node answers the Drain and may end the session at once: the
		// answer was queued before the end, so take it before telling how
		// the leave went.
		if ack := s.ctl.acks.take(); ack != nil {
			s.lv.answered(ack)
		}
		s.lv.ended(err, drained)
	}
	return sessionResult{connected: true, err: err, drained: drained, spread: s.ctl.reconnectSpread()}
}

// leave starts leaving: rejected routes are advertised no more.
func (s *sessionAttempt) leave() {
	s.readv.schedule(false)
	s.lv = s.l.startLeaving(s.sess)
}

// onAck takes the newest AdvertiseAck: the answer to the Drain while
// leaving, else the node's word on the routes.
func (s *sessionAttempt) onAck() {
	ack := s.ctl.acks.take()
	switch {
	case ack == nil: // taken already
	case s.lv != nil:
		s.lv.answered(ack)
	default:
		s.routes.update(s.l.log(), ack)
		s.l.recordAck(ack)
		s.readv.onAck(ack)
	}
}

// readvertise advertises again for the rejected routes, unless leaving.
func (s *sessionAttempt) readvertise() {
	s.readv.fired()
	if s.lv != nil {
		return
	}
	// An error: the session ended, which sess.Done reports.
	_ = s.sess.SendControl(s.adv)
}

// nodeDraining starts the node's Drain deadline. The node ends the
// session after the grace period; if it does not, the agent ends it at the
// deadline, so it reconnects.
func (s *sessionAttempt) nodeDraining(grace time.Duration) {
	s.stopDrainTimer()
	if s.lv == nil { // a link leaving stays so
		s.l.setState(StateDraining)
	}
	s.drainTimer = time.NewTimer(grace + s.a.drainMargin)
}

// drainC fires at the node's Drain deadline; nil (never) before a Drain.
func (s *sessionAttempt) drainC() <-chan time.Time {
	if s.drainTimer == nil {
		return nil
	}
	return s.drainTimer.C
}

func (s *sessionAttempt) stopDrainTimer() {
	if s.drainTimer != nil {
		s.drainTimer.Stop()
	}
}
