package agent

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// A link is the agent's session with one node of the cluster, kept by a
// goroutine of its own: it dials the node, advertises the routes, serves
// the connections the node opens, and reconnects with its own backoff
// whenever the session ends. Every link serves with the agent's one
// connector, so the connection limit and the tunnel budget are shared; a
// node's Drain, a failure or a leave concerns its link alone. The cluster
// (cluster.go) opens and retires links.

// linkOrigin is how a link came to be.
type linkOrigin int

const (
	// originServer: the server setting, the link the agent bootstraps with.
	originServer linkOrigin = iota
	// originMember: a member of the membership the nodes push.
	originMember
	// originAddress: an address of the server's host name
	// (server_each_address).
	originAddress
)

func (o linkOrigin) String() string {
	switch o {
	case originMember:
		return "membership"
	case originAddress:
		return "dns"
	}
	return "server"
}

// linkTarget is where a link dials. A link's target changes only for the
// bootstrap link, once the membership tells the URL of the node it
// reached (cluster.reconcile); an attempt reads it once, at its dial.
type linkTarget struct {
	// url is grpc://host:port or grpcs://host:port, as logs and the
	// status show it.
	url string
	// hostport is what gRPC dials.
	hostport string
	// serverName is the TLS server name to verify; "": the server's host
	// (nodeTLSConfig's).
	serverName string
	// authority is the :authority to send; "": hostport's. A link to an
	// address of the server's name names the server, as a dial of the
	// name would.
	authority string
	// member is the id of the member whose URL this is; "" for the
	// server setting and its addresses.
	member string
}

// link is one node's session and its reconnect cycle.
type link struct {
	a      *Agent
	origin linkOrigin
	target atomic.Pointer[linkTarget]
	// wake tells a link standing by that what kept it waiting may have
	// changed (standBy checks); never blocks a sender (capacity 1).
	wake chan struct{}
	// logger is the link's logger, with the id of the node it reached
	// (or, for a member before that, the member's).
	logger atomic.Pointer[zap.Logger]
	// current is the session while one runs.
	current atomic.Pointer[tunnelcore.Session]
	// established counts the sessions the node acknowledged; reconnects
	// the attempts after one ended or failed.
	established, reconnects atomic.Int64
	// laneRetryAt is when sessions may try the data lane again after one
	// failed to open (unix nanoseconds; see laneRetryAfter): per link, as
	// the path to each node may differ.
	laneRetryAt atomic.Int64
	// live is what the status reports of the link.
	live liveState

	// Leaving: leaveReq is cancelled once the link is to leave its node
	// (the agent's Leave, or the node left the membership), after
	// leaveCtx (the grace) and leaveWhy were stored; only the first
	// request counts.
	leaveOnce      sync.Once
	leaveReq       context.Context
	requestLeave   context.CancelFunc
	leaveCtx       context.Context
	leaveWhy       string
	stopAgentLeave func() bool // stops the watch of the agent's Leave

	// doneCtx ends when the link's goroutine returned.
	doneCtx context.Context
	end     context.CancelFunc
}

// newLink prepares a link to t; the cluster starts it (run).
func newLink(a *Agent, origin linkOrigin, t *linkTarget) *link {
	l := &link{a: a, origin: origin, wake: make(chan struct{}, 1)}
	l.target.Store(t)
	log := a.log
	if t.member != "" {
		log = log.With(zap.String("node_id", t.member))
	}
	l.logger.Store(log)
	l.live.setState(StateIdle)
	l.leaveReq, l.requestLeave = context.WithCancel(context.Background())
	l.doneCtx, l.end = context.WithCancel(context.Background())
	l.stopAgentLeave = context.AfterFunc(a.leaveReq, func() { l.leave(a.leaveCtx, errLeft.Error()) })
	return l
}

// log returns the link's logger.
func (l *link) log() *zap.Logger { return l.logger.Load() }

// reached sets the link's logger for the node id it reached and returns it.
func (l *link) reached(nodeID string) *zap.Logger {
	log := l.a.log.With(zap.String("node_id", nodeID))
	l.logger.Store(log)
	if m := l.target.Load().member; m != "" && nodeID != m {
		log.Warn("the node at this member's URL has another id than the membership gives it",
			zap.String("member", m), zap.String("server", l.target.Load().url))
	}
	return log
}

// leave asks the link to leave its node with the grace ctx leaves: it
// sends the node Drain, serves its open connections until the node ends
// the session or the grace is over, and does not reconnect. Only the
// first call counts; it reports whether this was it.
func (l *link) leave(ctx context.Context, why string) (first bool) {
	l.leaveOnce.Do(func() {
		l.leaveCtx, l.leaveWhy = ctx, why
		l.requestLeave()
		first = true
	})
	return first
}

// leaveAlone leaves the link's node with the shutdown grace, while the
// agent's other links stay: the node left the cluster, or the server's
// name no longer resolves to its address.
func (l *link) leaveAlone(why string) {
	ctx, cancel := context.WithTimeout(l.doneCtx, l.a.cfg.ShutdownGrace)
	context.AfterFunc(ctx, cancel) // releases the timer when the link ends
	if !l.leave(ctx, why) {
		cancel()
	}
}

// leaving reports whether the link was asked to leave.
func (l *link) leaving() bool { return l.leaveReq.Err() != nil }

// poke wakes a link standing by; it never blocks.
func (l *link) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// retarget makes the link's next attempts dial t.
func (l *link) retarget(t *linkTarget) {
	old := l.target.Swap(t)
	if old.url != t.url {
		l.log().Info("the node's sessions go to its URL from now on", zap.String("url", t.url), zap.String("was", old.url))
	}
	l.poke()
}

// run keeps the link's session until ctx ends or the link left its node:
// it connects, serves, and reconnects with jittered exponential backoff
// whenever the session ends. The end of a leave's grace ends ctx for the
// link, as Run's context does: the session, the upstream dials and relays
// under way stop.
func (l *link) run(ctx context.Context) {
	defer l.finish()
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	defer context.AfterFunc(l.leaveReq, func() { context.AfterFunc(l.leaveCtx, stop) })()
	bo := newBackoff(l.a.backoffInitial, l.a.backoffMax, l.a.linkRandN)
	announce := true // log "connecting" at info (first attempt, or after a session)
	failed := 0      // attempts in a row that got no session
	for ctx.Err() == nil && !l.leaving() {
		l.setState(StateConnecting)
		t := l.nextTarget(failed)
		l.logConnecting(announce, t)
		r := l.session(ctx, t)
		if ctx.Err() != nil || l.leaving() {
			return
		}
		if failed++; r.connected {
			failed = 0
		}
		if r.standby != "" {
			if !l.standBy(ctx, r) {
				return
			}
			announce = true
			continue
		}
		// A session another agent of the same id displaced does not
		// count as a good one: two agents sharing an id back off from
		// each other instead of trading places every second.
		if r.connected && !displaced(r.err) {
			bo.Reset()
		}
		announce = r.connected
		// After a node's Drain that asked for a reconnect spread, the
		// wait is drawn from [initial/2, spread], so that the node's
		// agents do not all come back within a second (backoff.Spread);
		// if that attempt fails, the backoff goes on as after any wait.
		wait := bo.Spread(r.spread)
		l.markDisconnected(StateRetrying)
		l.logEnd(r, wait, t)
		if !l.pause(ctx, wait) {
			return
		}
		l.reconnects.Add(1)
		l.a.counters.reconnects.Add(1)
	}
}

// finish marks the link stopped and takes it out of the cluster.
func (l *link) finish() {
	l.markDisconnected(StateStopped)
	l.stopAgentLeave()
	l.a.cluster.ended(l)
	l.end()
}

// pause waits d, unless ctx ends or the link leaves first (false).
func (l *link) pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-l.leaveReq.Done():
		return false
	case <-t.C:
		return true
	}
}

// standBy waits while the node the link reached is served by another
// link: a second session of the agent's id would displace that one's
// (the node keeps one per id), and its own in turn at the next reconnect.
// Two addresses of one node (IPv4 and IPv6), or a load balancer's name
// that led to a member the agent has a session with already, come to
// this. It returns false when ctx ended or the link left; true once the
// other link is gone or this one's target changed.
func (l *link) standBy(ctx context.Context, r sessionResult) bool {
	at := l.target.Load()
	l.live.setLastError(r.err.Error())
	l.live.setNodeID(r.standby)
	l.markDisconnected(StateStandby)
	l.log().Info("standing by: another session serves this node", zap.String("server", at.url),
		zap.String("reached_node", r.standby), zap.Error(r.err))
	for {
		select {
		case <-ctx.Done():
			return false
		case <-l.leaveReq.Done():
			return false
		case <-l.wake:
			if l.a.cluster.mayResume(l, at) {
				return true
			}
		}
	}
}

// fallbackAfter is how many attempts in a row the server's link makes to
// a member's URL, while no link has a session, before one to the server
// setting (nextTarget).
const fallbackAfter = 3

// nextTarget is where the next attempt dials: the link's target; but for
// the server's link that dials a member's URL, every fallbackAfter-th
// attempt in a row that found no session while no link of the agent has
// one, the server setting. Every node may have been replaced at once, with
// new addresses the agent cannot learn from a node it cannot reach; the
// server setting (a load balancer's name, a DNS name) finds the cluster
// again, whose membership the agent then takes (see fromMember).
func (l *link) nextTarget(failed int) *linkTarget {
	t := l.target.Load()
	if l.origin != originServer || t.member == "" || failed == 0 || failed%fallbackAfter != 0 || l.a.cluster.anyUp() {
		return t
	}
	return serverTarget(l.a.cfg)
}

// logConnecting logs an attempt to t: at info for the first one and
// after a session, at debug for the retries of failed attempts.
func (l *link) logConnecting(announce bool, t *linkTarget) {
	lvl := l.log().Debug
	if announce {
		lvl = l.log().Info
	}
	lvl("connecting", zap.String("server", t.url), zap.String("agent_id", l.a.cfg.ID))
}

// setState records a change of the link's state and of the agent's
// aggregate (Connected, State).
func (l *link) setState(s State) {
	l.live.setState(s)
	l.a.refreshConnected()
}

// state returns the link's state.
func (l *link) state() State {
	l.live.mu.Lock()
	defer l.live.mu.Unlock()
	return l.live.state
}

func (l *link) markConnected() {
	l.established.Add(1)
	l.a.sessions.Add(1)
	l.setState(StateConnected) // before the agent's channel closes, so waiters see it
}

func (l *link) markDisconnected(next State) {
	l.live.disconnected()
	l.setState(next)
}

// stats returns what the link's session holds (zero without one).
func (l *link) stats() tunnelcore.Stats {
	if s := l.current.Load(); s != nil {
		return s.Stats()
	}
	return tunnelcore.Stats{}
}

// logEnd logs the end of a session attempt to t and the coming retry.
func (l *link) logEnd(r sessionResult, wait time.Duration, t *linkTarget) {
	code, msg := statusOf(r.err)
	fields := []zap.Field{
		zap.String("server", t.url),
		zap.String("reason", msg),
		zap.String("retry_in", wait.Round(time.Millisecond).String()),
	}
	if code != codes.OK && code != codes.Unknown {
		fields = append(fields, zap.String("code", code.String()))
	}
	if r.connected {
		fields = append(fields, zap.String("connected_for", r.uptime.Round(time.Millisecond).String()))
	}
	if r.drained && r.spread > 0 {
		fields = append(fields, zap.String("reconnect_spread", r.spread.Round(time.Millisecond).String()))
	}
	l.live.setLastError(msg)
	if hint := connectHint(msg, l.a.cfg.serverTLS); hint != "" {
		fields = append(fields, zap.String("hint", hint))
	}
	log := l.log()
	switch {
	case code == codes.Unauthenticated || code == codes.PermissionDenied:
		log.Error("authentication failed; retrying", fields...)
	case displaced(r.err):
		log.Error("replaced by another connection with this agent id; is a second agent running with the same id? retrying", fields...)
	case r.drained:
		log.Info("disconnected: node drained; reconnecting", fields...)
	case r.connected:
		log.Warn("disconnected; reconnecting", fields...)
	default:
		log.Warn("connection failed; retrying", fields...)
	}
}

// serverTarget is the target of the server setting.
func serverTarget(cfg *Config) *linkTarget {
	_, hostport := cfg.ServerAddr()
	return &linkTarget{url: cfg.Server, hostport: hostport}
}

// memberTarget is the target of member id at url, a URL membership
// parsing normalised (scheme://host:port); the TLS server name is the
// URL's host, whose certificate the node presents.
func memberTarget(id, url string) *linkTarget {
	t := &linkTarget{url: url, member: id}
	_, t.hostport, _ = splitScheme(url)
	if host, _, err := net.SplitHostPort(t.hostport); err == nil {
		t.serverName = host
	}
	return t
}

// addressTarget is the target of one address of the server's host name:
// same port, and the TLS server name and :authority of the server's.
func addressTarget(cfg *Config, addr string) *linkTarget {
	useTLS, hostport := cfg.ServerAddr()
	scheme := "grpc://"
	if useTLS {
		scheme = "grpcs://"
	}
	return &linkTarget{url: scheme + addr, hostport: addr, authority: hostport}
}
