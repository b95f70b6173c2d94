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

// State is where an Agent, or one of its links (one per node), is in its
// connection cycle.
type State int32

const (
	// StateIdle: Run has not been called (a link: not started yet).
	StateIdle State = iota
	// StateConnecting: dialing the node and waiting for its AdvertiseAck.
	StateConnecting
	// StateConnected: the node acknowledged the Advertise; connections are served.
	StateConnected
	// StateRetrying: the last session ended or failed; waiting for the backoff.
	StateRetrying
	// StateStopped: Run returned (a link: it ended).
	StateStopped
	// StateDraining (a link): the node sent Drain; the session serves its
	// open connections until the node ends it, then the link reconnects.
	// The agent's State counts it as connected.
	StateDraining
	// StateLeaving (a link): the agent sent Drain (Leave, or the node left
	// the cluster) and serves the open connections until the node ends the
	// session; the link does not reconnect. The agent's State counts it as
	// connected.
	StateLeaving
	// StateStandby (a link): its address reached a node another link
	// serves already; it waits until that one is gone (see link.standBy).
	StateStandby
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
	case StateDraining:
		return "draining"
	case StateLeaving:
		return "leaving"
	case StateStandby:
		return "standby"
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// sessionUp reports whether a link in state s has an acknowledged session.
func sessionUp(s State) bool {
	return s == StateConnected || s == StateDraining || s == StateLeaving
}

// Option tunes an Agent beyond its Config.
type Option func(*Agent)

// WithBackoff sets the reconnect backoff: the ceiling starts at initial and
// doubles up to max; each wait is drawn from [ceiling/2, ceiling]. The
// default is 1 s doubling to 30 s. Meant for tests.
func WithBackoff(initial, max time.Duration) Option {
	return func(a *Agent) { a.backoffInitial, a.backoffMax = initial, max }
}

// runPhase is where an Agent is in its one Run.
type runPhase int32

const (
	phaseIdle    runPhase = iota // Run not called
	phaseRunning                 // Run running
	phaseStopped                 // Run returned
)

// Agent keeps a session with every node of a sluice cluster (one link per
// node; a single node is a cluster of one): it connects, advertises its
// upstreams on every session, serves the connections the nodes open, and
// reconnects each with backoff whenever it ends. The nodes push the
// cluster's membership; with server_each_address the server's DNS name
// is the membership instead (cluster.go).
type Agent struct {
	cfg      *Config
	log      *zap.Logger
	conn     *connector
	cluster  *cluster
	sessions atomic.Int64       // sessions acknowledged so far, all links
	budget   *tunnelcore.Budget // windows above 64 KiB, shared by the agent's sessions
	limits   tunnelcore.Limits  // as derived from the config (agentLimits)
	// counters feed the admin listener's metrics and status; tunnel
	// counts what the sessions' datagram flows carried and dropped.
	counters *connCounters
	tunnel   tunnelcore.Counters
	// adminAddr is the admin listener's address while it listens.
	adminAddr atomic.Pointer[net.TCPAddr]
	// nodeTLS is the TLS configuration of the connections to the nodes
	// (nil for grpc://) and cert the client certificate presented on
	// them (nil: none); attemptCredentials combines them per attempt.
	nodeTLS *tls.Config
	cert    *clientCert
	// resolve looks up the server's host for server_each_address; tests
	// replace it. serverRefresh is how often (Config.ServerRefresh).
	resolve       resolveFunc
	serverRefresh time.Duration

	backoffInitial, backoffMax time.Duration
	onConnEnd                  func(ConnReport) // WithConnEnd; nil: none
	ackTimeout                 time.Duration
	drainMargin                time.Duration
	// linkRandN draws the links' reconnect waits (backoff.randN); nil:
	// math/rand/v2. Tests replace it.
	linkRandN func(n int64) int64

	phase   atomic.Int32  // runPhase
	stopped chan struct{} // closed when Run returns

	// Leave: leaveReq is cancelled once it was called, after leaveCtx
	// (its grace) was stored.
	leaveOnce    sync.Once
	leaveReq     context.Context
	requestLeave context.CancelFunc
	leaveCtx     context.Context

	// connected is closed while at least one link has a session;
	// refreshConnected replaces it when none has.
	connMu    sync.Mutex
	connected chan struct{}

	tokenMu   sync.Mutex
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
		resolve:        net.DefaultResolver.LookupNetIP,
		serverRefresh:  cfg.ServerRefresh,
		connected:      make(chan struct{}),
		stopped:        make(chan struct{}),
		lastToken:      cfg.Token,
	}
	lim := agentLimits(cfg)
	a.limits = lim
	a.budget = tunnelcore.NewBudget(lim.Budget)
	a.counters = newConnCounters(cfg)
	a.cluster = newCluster(a)
	a.leaveReq, a.requestLeave = context.WithCancel(context.Background())
	for _, o := range opts {
		o(a)
	}
	logger = a.log // WithLogger
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

// State returns where the agent is in its connection cycle: while Run
// runs, the most advanced state of its links, a link with a session
// (draining or leaving too) counting as connected; connecting while it has
// no link yet (server_each_address before the name resolved).
func (a *Agent) State() State {
	switch runPhase(a.phase.Load()) {
	case phaseIdle:
		return StateIdle
	case phaseStopped:
		return StateStopped
	}
	return a.cluster.state()
}

// Connected returns a channel that is closed once the agent is connected:
// a node acknowledged the Advertise of at least one link. After the last
// link's session ended, later calls return a new channel.
func (a *Agent) Connected() <-chan struct{} {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	return a.connected
}

// WaitConnected waits until the agent is connected (at least one link) or
// ctx is done.
func (a *Agent) WaitConnected(ctx context.Context) error {
	select {
	case <-a.Connected():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// refreshConnected closes or replaces the Connected channel as the links'
// sessions say. It reads them under connMu, so that of two links changing
// at once the later call sees both changes.
func (a *Agent) refreshConnected() {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	up := a.cluster.anyUp()
	select {
	case <-a.connected:
		if !up {
			a.connected = make(chan struct{})
		}
	default:
		if up {
			close(a.connected)
		}
	}
}

// NodeID returns the id of the node of the first link with a session, in
// the order the links were opened (the server's first), or "" while none
// has one.
func (a *Agent) NodeID() string {
	for _, l := range a.cluster.links() {
		if sessionUp(l.state()) {
			return l.live.node()
		}
	}
	return ""
}

// ActiveConns returns the number of connections being dialed or relayed,
// all links.
func (a *Agent) ActiveConns() int { return a.conn.Active() }

// connEnded counts an ended connection for the metrics and status, then
// hands it to WithConnEnd's function.
func (a *Agent) connEnded(r ConnReport) {
	a.counters.record(r)
	if a.onConnEnd != nil {
		a.onConnEnd(r)
	}
}

// Stats returns what the links' sessions hold, summed (zero while none
// has one): their connections, the bytes received and not yet relayed to
// upstreams, and the bytes queued towards the nodes.
func (a *Agent) Stats() tunnelcore.Stats {
	var st tunnelcore.Stats
	for _, l := range a.cluster.links() {
		s := l.stats()
		st.Conns += s.Conns
		st.Buffered += s.Buffered
		st.Queued += s.Queued
		st.Spliced += s.Spliced
		st.Direct += s.Direct
	}
	return st
}

// Sessions returns how many sessions the nodes have acknowledged since the
// agent started, all links: it grows by one with every reconnect.
func (a *Agent) Sessions() int64 { return a.sessions.Load() }

// Run connects to the cluster and serves it until ctx is cancelled: one
// link per node, each reconnecting with jittered exponential backoff
// whenever its session ends. It returns nil after ctx is cancelled, once
// the sessions are closed and the connection handlers finished (waiting
// at most 5 s for them), or after Leave once every link left. An Agent
// runs once.
func (a *Agent) Run(ctx context.Context) error {
	if !a.phase.CompareAndSwap(int32(phaseIdle), int32(phaseRunning)) {
		return errors.New("agent: Run called twice")
	}
	// The end of a Leave's grace stops everything, as ctx does: the
	// sessions, the upstream dials and relays under way.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	defer context.AfterFunc(a.leaveReq, func() { context.AfterFunc(a.leaveCtx, stop) })()
	defer func() {
		a.phase.Store(int32(phaseStopped))
		a.refreshConnected()
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
	a.cluster.run(ctx)
	return nil
}

// Leave stops the agent gracefully, as sluice-agent does on SIGINT or
// SIGTERM. Every link, at once, sends its node Drain: the node routes no
// new connections to it (other agents serving the same hosts take them, as
// when it is gone), closes its idle pooled HTTP connections to it, and ends
// the session once no connection is open on it. Run returns nil once every
// link's session ended; the agent serves on until then. If ctx is done
// first (the grace is over, or the caller cancelled it), Run's context
// ends: the connections still open are cut, the upstream dials under way
// given up.
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
	if runPhase(a.phase.Load()) == phaseIdle {
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
		// keepalive_time is at least the nodes' enforcement MinTime
		// (Validate), or they would GOAWAY the connection.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                a.cfg.KeepaliveTime,
			Timeout:             a.cfg.KeepaliveTimeout,
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
			UdpIdleTimeoutMs:      uint32(u.UDPIdleTimeout / time.Millisecond),
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
	a.tokenMu.Lock()
	defer a.tokenMu.Unlock()
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
