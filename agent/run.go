package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Version is the agent's version, reported in Advertise.build. Release
// builds set it with -ldflags "-X github.com/sluice-tunnel/sluice/agent.Version=v1.2.3";
// otherwise it is sluice's module version from the build info, or "devel".
var Version = ""

// BuildString returns "sluice-agent <version> (<go version>)", built as
// the node builds its own (tunnelpb.Build).
func BuildString() string { return tunnelpb.Build("sluice-agent", Version) }

// Timeouts of the session handshake and shutdown.
const (
	// ackTimeout bounds the wait for the node's AdvertiseAck.
	ackTimeout = 10 * time.Second
	// shutdownWait bounds how long Run waits for connection handlers.
	shutdownWait = 5 * time.Second
	// drainMargin is how long after a Drain's grace period the agent waits
	// for the node to end the session before ending it itself.
	drainMargin = 5 * time.Second
	// recvErrWait bounds the wait for the stream's final status after the
	// session ended on a send error.
	recvErrWait = 2 * time.Second
)

// State is where an Agent is in its connection cycle.
type State int32

const (
	// StateIdle: Run has not been called.
	StateIdle State = iota
	// StateConnecting: dialing the node and waiting for its AdvertiseAck.
	StateConnecting
	// StateConnected: the node acknowledged the Advertise; connections are served.
	StateConnected
	// StateRetrying: the last session ended or failed; waiting for the backoff.
	StateRetrying
	// StateStopped: Run returned.
	StateStopped
)

func (s State) String() string {
	switch s {
	case StateIdle:
		return "idle"
	case StateConnecting:
		return "connecting"
	case StateConnected:
		return "connected"
	case StateRetrying:
		return "retrying"
	case StateStopped:
		return "stopped"
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Option tunes an Agent beyond its Config.
type Option func(*Agent)

// WithBackoff sets the reconnect backoff: the ceiling starts at initial and
// doubles up to max; each wait is drawn from [ceiling/2, ceiling]. The
// default is 1 s doubling to 30 s. Meant for tests.
func WithBackoff(initial, max time.Duration) Option {
	return func(a *Agent) { a.backoffInitial, a.backoffMax = initial, max }
}

// Agent keeps one session to a sluice node: it connects, advertises its
// upstreams, serves the connections the node opens, and reconnects with
// backoff whenever the session ends.
type Agent struct {
	cfg      *Config
	log      *zap.Logger
	conn     *connector
	sessions atomic.Int64 // sessions acknowledged so far
	current  atomic.Pointer[tunnelcore.Session]
	budget   *tunnelcore.Budget // windows above 64 KiB, shared by the agent's sessions
	limits   tunnelcore.Limits  // as derived from the config (agentLimits)
	// counters and live feed the admin listener's metrics and status.
	counters *connCounters
	live     liveState
	// adminAddr is the admin listener's address while it listens.
	adminAddr atomic.Pointer[net.TCPAddr]
	// laneRetryAt is when sessions may try the data lane again after one
	// failed to open (unix nanoseconds; see laneRetryAfter).
	laneRetryAt atomic.Int64
	// nodeTLS is the TLS configuration of the connections to the node
	// (nil for grpc://) and cert the client certificate presented on
	// them (nil: none); attemptCredentials combines them per attempt.
	nodeTLS *tls.Config
	cert    *clientCert

	backoffInitial, backoffMax time.Duration
	onConnEnd                  func(ConnReport) // WithConnEnd; nil: none
	ackTimeout                 time.Duration
	drainMargin                time.Duration

	running atomic.Bool
	state   atomic.Int32
	stopped chan struct{} // closed when Run returns

	// Leave: leaveReq is cancelled once it was called, after leaveCtx
	// (its grace) was stored.
	leaveOnce    sync.Once
	leaveReq     context.Context
	requestLeave context.CancelFunc
	leaveCtx     context.Context

	mu        sync.Mutex
	connected chan struct{} // closed while connected; replaced on disconnect
	nodeID    string
	lastToken string // the token last read from TokenFile (or Token)
	tokenErr  string // the last token_file error logged, to log each once
}

// New prepares an agent for cfg, which it validates (Validate fills in
// defaults such as the id). It fails on an invalid configuration, such as
// an unreadable CA file. A nil logger logs nothing.
func New(cfg *Config, logger *zap.Logger, opts ...Option) (*Agent, error) {
	if cfg == nil {
		return nil, errors.New("agent: nil config")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	a := &Agent{
		cfg:            cfg,
		log:            logger,
		backoffInitial: defaultBackoffInitial,
		backoffMax:     defaultBackoffMax,
		ackTimeout:     ackTimeout,
		drainMargin:    drainMargin,
		connected:      make(chan struct{}),
		stopped:        make(chan struct{}),
		lastToken:      cfg.Token,
	}
	lim := agentLimits(cfg)
	a.limits = lim
	a.budget = tunnelcore.NewBudget(lim.Budget)
	a.counters = newConnCounters(cfg)
	a.live.setState(StateIdle)
	a.leaveReq, a.requestLeave = context.WithCancel(context.Background())
	for _, o := range opts {
		o(a)
	}
	var err error
	if a.nodeTLS, err = nodeTLSConfig(cfg); err != nil {
		return nil, err
	}
	if a.cert, err = newClientCert(cfg, logger); err != nil {
		return nil, err
	}
	a.conn = newConnector(cfg, lim.MaxConnections, logger)
	a.conn.onEnd = a.connEnded
	logLimits(logger, cfg, lim)
	warnPlaintextToken(logger, cfg)
	warnAdminExposed(logger, cfg.AdminListen)
	return a, nil
}

// agentLimits derives what cfg leaves unset as the node derives its own:
// half the memory limit for the data plane, an eighth of it for the tunnel
// budget, the rest for connections at tunnelcore.ConnectionCost each.
func agentLimits(cfg *Config) tunnelcore.Limits {
	return tunnelcore.DeriveLimits(tunnelcore.MemoryLimit(), cfg.TunnelBudget, 0, int64(cfg.MaxConnections))
}

// starvedConnections is the derived connection limit below which the agent
// warns at start: a tunnel_budget that takes (nearly) all of half the
// memory leaves room for a handful of connections, and the refusals that
// follow would otherwise puzzle.
const starvedConnections = 16

func logLimits(log *zap.Logger, cfg *Config, lim tunnelcore.Limits) {
	log.Info("limits", zap.Int64("memory_limit", lim.Memory), zap.Int64("tunnel_budget", lim.Budget),
		zap.Int64("max_connections", lim.MaxConnections))
	if cfg.MaxConnections == 0 && lim.MaxConnections < starvedConnections {
		log.Warn("the memory limit leaves room for few connections; lower tunnel_budget or set max_connections",
			zap.Int64("max_connections", lim.MaxConnections), zap.Int64("tunnel_budget", lim.Budget),
			zap.Int64("memory_limit", lim.Memory), zap.Int64("bytes_per_connection", tunnelcore.ConnectionCost))
	}
}

// Run runs the agent with cfg until ctx is cancelled; see Agent.Run.
func Run(ctx context.Context, cfg *Config, logger *zap.Logger) error {
	a, err := New(cfg, logger)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}

// State returns where the agent is in its connection cycle.
func (a *Agent) State() State { return State(a.state.Load()) }

// Connected returns a channel that is closed once the agent is connected
// (the node acknowledged its Advertise). After a disconnect, later calls
// return a new channel.
func (a *Agent) Connected() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.connected
}

// WaitConnected waits until the agent is connected or ctx is done.
func (a *Agent) WaitConnected(ctx context.Context) error {
	select {
	case <-a.Connected():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NodeID returns the id of the node of the current session, or "" while
// not connected.
func (a *Agent) NodeID() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.nodeID
}

// ActiveConns returns the number of connections being dialed or relayed.
func (a *Agent) ActiveConns() int { return a.conn.Active() }

func (a *Agent) setState(s State) {
	a.state.Store(int32(s))
	a.live.setState(s)
}

// connEnded counts an ended connection for the metrics and status, then
// hands it to WithConnEnd's function.
func (a *Agent) connEnded(r ConnReport) {
	a.counters.record(r)
	if a.onConnEnd != nil {
		a.onConnEnd(r)
	}
}

// Stats returns what the current session holds (zero while disconnected):
// its connections, the bytes received and not yet relayed to upstreams, and
// the bytes queued towards the node.
func (a *Agent) Stats() tunnelcore.Stats {
	if s := a.current.Load(); s != nil {
		return s.Stats()
	}
	return tunnelcore.Stats{}
}

// Sessions returns how many sessions the node has acknowledged since the
// agent started: it grows by one with every reconnect.
func (a *Agent) Sessions() int64 { return a.sessions.Load() }

func (a *Agent) markConnected(nodeID string) {
	a.sessions.Add(1)
	a.mu.Lock()
	a.nodeID = nodeID
	a.setState(StateConnected) // before the channel closes, so waiters see it
	select {
	case <-a.connected:
	default:
		close(a.connected)
	}
	a.mu.Unlock()
}

func (a *Agent) markDisconnected(next State) {
	a.live.disconnected()
	a.mu.Lock()
	a.nodeID = ""
	a.setState(next)
	select {
	case <-a.connected:
		a.connected = make(chan struct{})
	default:
	}
	a.mu.Unlock()
}

// Run connects to the node and serves it until ctx is cancelled,
// reconnecting with jittered exponential backoff whenever the session ends.
// It returns nil after ctx is cancelled, once the session is closed and the
// connection handlers finished (waiting at most 5 s for them). An Agent runs
// once.
func (a *Agent) Run(ctx context.Context) error {
	if !a.running.CompareAndSwap(false, true) {
		return errors.New("agent: Run called twice")
	}
	// The end of a Leave's grace stops everything, as ctx does: the
	// session, the upstream dials and relays under way.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	defer context.AfterFunc(a.leaveReq, func() { context.AfterFunc(a.leaveCtx, stop) })()
	defer func() {
		a.markDisconnected(StateStopped)
		if !a.conn.wait(shutdownWait) {
			a.log.Warn("connections still open at shutdown", zap.Int("connections", a.conn.Active()))
		}
		a.log.Info("agent stopped")
		close(a.stopped)
	}()
	stopAdmin, err := a.startAdmin()
	if err != nil {
		return err
	}
	defer stopAdmin()

	bo := newBackoff(a.backoffInitial, a.backoffMax, nil)
	announce := true // log "connecting" at info (first attempt, or after a session)
	for ctx.Err() == nil {
		a.setState(StateConnecting)
		lvl := a.log.Debug
		if announce {
			lvl = a.log.Info
		}
		lvl("connecting", zap.String("server", a.cfg.Server), zap.String("agent_id", a.cfg.ID))

		r := a.session(ctx)
		if ctx.Err() != nil || a.leavingNow() {
			return nil
		}
		// A session another agent of the same id displaced does not
		// count as a good one: two agents sharing an id back off from
		// each other instead of trading places every second.
		if r.connected && !displaced(r.err) {
			bo.Reset()
		}
		announce = r.connected
		wait := bo.Next()
		a.markDisconnected(StateRetrying)
		a.logEnd(r, wait)

		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-a.leaveReq.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		a.counters.reconnects.Add(1)
	}
	return nil
}

// Leave stops the agent gracefully, as sluice-agent does on SIGINT or
// SIGTERM. The agent sends the node Drain: the node routes no new
// connections to it (other agents serving the same hosts take them, as
// when it is gone), closes its idle pooled HTTP connections to it, and ends
// the session once no connection is open on it; Run then returns nil. The
// agent serves on until then. If ctx is done first (the grace is over, or
// the caller cancelled it), Run's context ends: the connections still open
// are cut, the upstream dials under way given up.
//
// Leave returns when Run has returned: nil, or ctx.Err() when the grace
// ran out. A node older than this agent does not answer Drain, so the
// agent then takes the whole grace. Leave before Run returns at once and
// makes Run return at once; only the first call's ctx counts.
func (a *Agent) Leave(ctx context.Context) error {
	a.leaveOnce.Do(func() {
		a.leaveCtx = ctx
		a.requestLeave()
	})
	if !a.running.Load() {
		return nil
	}
	select {
	case <-a.stopped:
		return nil
	case <-ctx.Done():
		<-a.stopped
		return ctx.Err()
	}
}

// leavingNow reports whether Leave was called.
func (a *Agent) leavingNow() bool { return a.leaveReq.Err() != nil }

// displaced reports whether the node ended the session because a newer
// stream of the same agent id replaced it.
func displaced(err error) bool {
	code, msg := statusOf(err)
	return code == codes.Aborted && strings.Contains(msg, tunnelpb.StatusReplaced)
}

// connectHint says what to check for the connection errors a wrong server
// setting produces, whose gRPC wording names none of it: a port that is
// Caddy's HTTP site rather than the control plane, grpc:// against TLS and
// grpcs:// against plaintext, an untrusted certificate, a client
// certificate missing or refused (TLS alerts), nothing listening.
func connectHint(msg string, useTLS bool) string {
	switch {
	case strings.Contains(msg, "looked like an HTTP/1.1 header"):
		return "the server speaks HTTP/1.1, not a sluice control plane: check the port (the node's sluice listen address, default :8001)"
	case strings.Contains(msg, "unexpected HTTP status code received from server"),
		strings.Contains(msg, "malformed header: missing HTTP content-type"):
		return "the server answered with an HTTP page, not as a sluice control plane: check the port is the node's sluice listen address (default :8001) and, behind a proxy, that it forwards gRPC there"
	case !useTLS && (strings.Contains(msg, "error reading server preface: EOF") || strings.Contains(msg, "frame too large")):
		return "if the node serves the control plane over TLS (sluice tls), use grpcs://"
	case useTLS && strings.Contains(msg, "first record does not look like a TLS handshake"):
		return "the server does not speak TLS: use grpc://, or give the node's sluice block a tls certificate"
	case useTLS && strings.Contains(msg, "certificate signed by unknown authority"):
		return "trust the node's CA with ca_file (or, for a test, insecure: true)"
	case useTLS && strings.Contains(msg, "remote error: tls: certificate required"):
		return "the node requires a client certificate: set cert_file and key_file"
	case useTLS && (strings.Contains(msg, "remote error: tls: unknown certificate authority") ||
		strings.Contains(msg, "remote error: tls: bad certificate") || strings.Contains(msg, "remote error: tls: expired certificate")):
		return "the node refused the client certificate (cert_file): it must be current and signed by the CA of the node's client_auth"
	case strings.Contains(msg, "connection refused"):
		return "nothing listens there: is Caddy running, with its sluice control plane on this address?"
	case strings.Contains(msg, "produced zero addresses"), strings.Contains(msg, "no such host"):
		return "the server's host name does not resolve: check the host in server, and this host's DNS"
	}
	return ""
}

// logEnd logs the end of a session attempt and the coming retry.
func (a *Agent) logEnd(r sessionResult, wait time.Duration) {
	code, msg := statusOf(r.err)
	fields := []zap.Field{
		zap.String("server", a.cfg.Server),
		zap.String("reason", msg),
		zap.String("retry_in", wait.Round(time.Millisecond).String()),
	}
	if code != codes.OK && code != codes.Unknown {
		fields = append(fields, zap.String("code", code.String()))
	}
	if r.connected {
		fields = append(fields, zap.String("connected_for", r.uptime.Round(time.Millisecond).String()))
	}
	a.live.setLastError(msg)
	if hint := connectHint(msg, a.cfg.serverTLS); hint != "" {
		fields = append(fields, zap.String("hint", hint))
	}
	switch {
	case code == codes.Unauthenticated || code == codes.PermissionDenied:
		a.log.Error("authentication failed; retrying", fields...)
	case displaced(r.err):
		a.log.Error("replaced by another connection with this agent id; is a second agent running with the same id? retrying", fields...)
	case r.drained:
		a.log.Info("disconnected: node drained; reconnecting", fields...)
	case r.connected:
		a.log.Warn("disconnected; reconnecting", fields...)
	default:
		a.log.Warn("connection failed; retrying", fields...)
	}
}

// statusOf extracts the gRPC status from err (possibly wrapped by the
// session), or codes.Unknown and err's text.
func statusOf(err error) (codes.Code, string) {
	if err == nil {
		return codes.OK, "session ended"
	}
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		if st := se.GRPCStatus(); st != nil && st.Code() != codes.OK {
			return st.Code(), st.Message()
		}
	}
	if errors.Is(err, io.EOF) {
		return codes.Unknown, "node ended the session"
	}
	return codes.Unknown, err.Error()
}

// recordingStream remembers the first error RecvMsg returns: a client
// stream's SendMsg reports only io.EOF when the server ended the stream,
// and the status (e.g. Unauthenticated) is what RecvMsg returns.
type recordingStream struct {
	grpc.BidiStreamingClient[tunnelpb.Frame, tunnelpb.Frame]
	once     sync.Once
	recvErr  error
	recvDone chan struct{}
}

func (r *recordingStream) RecvMsg(m any) error {
	err := r.BidiStreamingClient.RecvMsg(m)
	if err != nil {
		r.once.Do(func() {
			r.recvErr = err
			close(r.recvDone)
		})
	}
	return err
}

// dialOptions are the gRPC options of the connection to the node, with
// the attempt's credentials (attemptCredentials), which record the
// socket's progress for the session's stall watchdog
// (tunnelcore.ProgressCredentials).
func (a *Agent) dialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(tunnelcore.ProgressCredentials(creds)),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})),
		// DATA buffers come from tunnelcore's pool (not zeroed on reuse),
		// larger socket buffers halve the syscalls per byte, and static
		// windows spare the BDP pings (see tunnelcore.GRPCWindowSize).
		experimental.WithBufferPool(tunnelcore.BufferPool()),
		grpc.WithReadBufferSize(tunnelcore.GRPCBufferSize),
		grpc.WithWriteBufferSize(tunnelcore.GRPCBufferSize),
		grpc.WithInitialWindowSize(tunnelcore.GRPCWindowSize),
		grpc.WithInitialConnWindowSize(tunnelcore.GRPCWindowSize),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                30 * time.Second,
			Timeout:             10 * time.Second,
			PermitWithoutStream: true,
		}),
		// The agent's own backoff paces reconnects; each session gets a
		// fresh ClientConn, so gRPC's backoff only bounds one attempt.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           grpcbackoff.DefaultConfig,
			MinConnectTimeout: 10 * time.Second,
		}),
		grpc.WithUserAgent(BuildString()),
	}
}

// advertise is the Advertise frame for the configured upstreams, sent as
// Validate normalised them.
func (a *Agent) advertise() *tunnelpb.Frame {
	routes := make([]*tunnelpb.Route, 0, len(a.cfg.Upstreams))
	for _, u := range a.cfg.Upstreams {
		scheme, _ := u.TargetURL()
		routes = append(routes, &tunnelpb.Route{
			Name:           u.Name,
			Host:           u.Host,
			HostPattern:    u.HostPattern,
			Target:         u.Target,
			RewriteHost:    u.RewriteHost,
			TlsPassthrough: u.TLSPassthrough,
			ListenPort:     uint32(u.ListenPort),
			AllowedCidrs:   slices.Clone(u.AllowedCIDRs),
			// The connector speaks HTTP/1.1 to https targets (see
			// Upstream.ForceHTTP1): the node must not send HTTP/2.
			ForceHttp1:            u.ForceHTTP1 || scheme == "https",
			VerbatimIdleTimeoutMs: uint32(u.VerbatimIdleTimeout / time.Millisecond),
			// Each connection's PROXY header names one client: the node
			// must not pool them across clients.
			ProxyProtocol: u.ProxyProtocol != "",
		})
	}
	return &tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId:       a.cfg.ID,
		Build:         BuildString(),
		Routes:        routes,
		InitialWindow: tunnelcore.InitialWindow,
	}}}
}

// token returns the bearer token for a new session. A token_file is read
// again for each attempt, so an operator rotating the node's token writes
// the new one to the agents' files and restarts nothing. A file that cannot
// be read (being rewritten, say) keeps the token read before; each new
// problem is logged once.
func (a *Agent) token() string {
	if a.cfg.TokenFile == "" {
		return a.cfg.Token
	}
	tok, err := readTokenFile(a.cfg.TokenFile)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		if msg := err.Error(); msg != a.tokenErr {
			a.tokenErr = msg
			a.log.Warn("cannot read token_file; using the token read before", zap.Error(err))
		}
		return a.lastToken
	}
	a.tokenErr = ""
	if tok != a.lastToken {
		a.log.Info("token_file holds a new token; using it", zap.String("token_file", a.cfg.TokenFile))
		a.lastToken = tok
	}
	return tok
}

// streamProgress is the stall watchdog's reader of the bytes the stream's
// TCP connection delivered, from the AuthInfo the connection's handshake
// recorded (nil where it could not: the watchdog then times blocked Sends
// alone).
func streamProgress(st grpc.ClientStream) func() uint64 {
	if p, ok := peer.FromContext(st.Context()); ok {
		return tunnelcore.ProgressOf(p.AuthInfo)
	}
	return nil
}
