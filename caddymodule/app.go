package caddymodule

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/ident"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

func init() {
	caddy.RegisterModule(App{})
}

// nodePool holds the nodes by control address across config reloads.
var nodePool = caddy.NewUsagePool()

// DefaultListen is the control address when none is configured.
const DefaultListen = ":8001"

// App is the sluice app: the gRPC control plane that sluice-agents dial out
// to, and the registry of their sessions and routes. The control plane, its
// listener and the sessions are shared by every config that names the same
// listen address, so `caddy reload` keeps every agent connected.
type App struct {
	// Listen is the control-plane address agents dial, as a Caddy network
	// address. Default ":8001".
	Listen string `json:"listen,omitempty"`

	// Token is the bearer token agents must present. Mutually exclusive
	// with TokenFile. With neither, a token is generated once, written to
	// the sluice folder of Caddy's data directory, and its path is logged.
	Token string `json:"token,omitempty"`

	// TokenFile is a file holding the token (surrounding whitespace is
	// ignored).
	TokenFile string `json:"token_file,omitempty"`

	// Credentials are named agent credentials, each a token or a client
	// certificate identity with the scope of what its agents may serve.
	// The token above is the unscoped credential beside them; with
	// credentials or client_auth configured, none is generated.
	Credentials []*Credential `json:"credentials,omitempty"`

	// ClientAuth verifies agents' client certificates against a CA of
	// Caddy's pki app; a certificate's identity selects its credential.
	ClientAuth *ClientAuth `json:"client_auth,omitempty"`

	// TLSInternal serves the control plane with a certificate issued by
	// the client_auth CA (else the "local" CA) instead of certificate
	// files, so the CA bundle `caddy sluice issue-cert` returns lets an
	// agent verify the node too.
	TLSInternal *InternalTLS `json:"tls_internal,omitempty"`

	// TLSCertFile and TLSKeyFile serve the control plane over TLS (agents
	// then dial grpcs://). Both or neither. A reload serves the files it
	// names to new agent connections (a renewed certificate takes effect
	// without dropping an agent); turning TLS on or off for a control
	// address that is already listening is refused, since it needs a new
	// listener: restart Caddy or use another listen address.
	TLSCertFile string `json:"tls_cert_file,omitempty"`
	TLSKeyFile  string `json:"tls_key_file,omitempty"`

	// AdvertiseTimeout is how long a new agent stream may take to send its
	// Advertise before it is failed with DEADLINE_EXCEEDED. Default 10s.
	AdvertiseTimeout caddy.Duration `json:"advertise_timeout,omitempty"`

	// TCPPortRange is the list of ports agents may claim with listen-port
	// routes: comma-separated ports and lo-hi ranges ("16000-16099,17000";
	// overlapping pieces are merged); the app binds each claimed port while its
	// agent is connected. Unset: the app binds none, and listen-port routes
	// are served only by layer4 servers of the config that route by port.
	// A reload that changes the range (or tcp_bind) applies to connected
	// agents at once: ports it excludes are closed (connections already
	// relayed keep running) and reported rejected to their agents, ports it
	// now includes are bound. Claimed ports bind without SO_REUSEPORT, so a
	// claim never shares a port with a Caddy listener; moving a claimed port
	// to a layer4 server of the config therefore takes two reloads (first
	// take it out of the range, then add the server), as the new server
	// cannot bind while the claim still holds the port.
	TCPPortRange string `json:"tcp_port_range,omitempty"`

	// TCPBind is the host the claimed ports bind on. Default: all
	// interfaces.
	TCPBind string `json:"tcp_bind,omitempty"`

	// VerbatimIdleTimeout closes a relayed TCP connection (layer4 or a
	// claimed port) that moved no byte in either direction for this long,
	// unless its route sets its own. Default 0: off.
	VerbatimIdleTimeout caddy.Duration `json:"verbatim_idle_timeout,omitempty"`

	// MaxConnections bounds the virtual connections open at once, HTTP and
	// TCP. Past it, HTTP requests get 503 with Retry-After and TCP
	// connections are closed. Idle pooled upstream connections hold slots
	// too; a connection that finds every slot taken first closes them and
	// waits up to 250 ms for a slot of a closing connection. 0:
	// ConnectionMemory / 293 KiB.
	MaxConnections int64 `json:"max_connections,omitempty"`

	// ConnectionMemory is the memory connections may take at their worst
	// (293 KiB each). 0: half the memory limit (GOMEMLIMIT, else the cgroup
	// limit, else physical memory) less the tunnel budget.
	ConnectionMemory int64 `json:"connection_memory,omitempty"`

	// MaxConnectionsPerAddress bounds the requests in flight and relayed
	// connections of one client address. 0: no limit.
	MaxConnectionsPerAddress int `json:"max_connections_per_address,omitempty"`

	// TunnelBudget is what receive windows above 64 KiB may hold, across
	// all agents. One connection grows within its share of it (the budget
	// over the connections holding part of it, plus one), so a few bulk
	// transfers cannot take it whole. 0: an eighth of half the memory
	// limit.
	TunnelBudget int64 `json:"tunnel_budget,omitempty"`

	// MaxSessions bounds the agent sessions; beyond it a new agent stream
	// is refused with RESOURCE_EXHAUSTED (agents retry with backoff). An
	// agent replacing its own session, or succeeding its one leaving
	// session (shutting down), is always admitted. Default 1024: every
	// session holds its routes, patterns and buffers, so a leaked token
	// must not be able to open them without end.
	MaxSessions int `json:"max_sessions,omitempty"`

	// MaxSessionsPerAddress bounds the sessions from one address. 0: no limit.
	MaxSessionsPerAddress int `json:"max_sessions_per_address,omitempty"`

	// MaxPendingStreams bounds the agent streams that have not sent their
	// Advertise yet, and, apart from them, the control connections that
	// have not authenticated yet: a stream with the token, or a data lane
	// or direct socket with a valid ticket or key. Such a connection must
	// send its first byte within 2 s and authenticate within 10 s. A new
	// connection that finds the pending connections at a limit evicts the
	// oldest of them (a silent one first) rather than being refused; at
	// this node-wide limit, the oldest of the site (/24, /48) holding the
	// most. So connections held open, or churned from a few sites, without
	// the token cannot keep agents out.
	// Default 256.
	MaxPendingStreams int `json:"max_pending_streams,omitempty"`

	// MaxPendingStreamsPerAddress bounds both per address; pending
	// connections are also bounded per network (/24 for IPv4, /64 for
	// IPv6) at four times this. Peers without an IP address (a unix
	// socket's) are bounded by MaxPendingStreams alone. Default 16.
	MaxPendingStreamsPerAddress int `json:"max_pending_streams_per_address,omitempty"`

	// TunnelStallTimeout fails a session whose agent stopped taking frames
	// for this long while frames waited (the agent reconnects). A link that
	// still moves 16 KiB per timeout is not cut: the watchdog reads the TCP
	// connection's acknowledged bytes (Linux). Default 60s; negative: off.
	TunnelStallTimeout caddy.Duration `json:"tunnel_stall_timeout,omitempty"`

	// DrainGrace is how long in-flight tunnel connections may finish when
	// the node shuts down, before the streams are closed. Default 10s.
	DrainGrace caddy.Duration `json:"drain_grace,omitempty"`

	// DisableDataLane stops offering agents the data lane: a second
	// connection to the control address that carries a session's frames
	// without gRPC's HTTP/2 framing, which costs this node about a quarter
	// less CPU per tunneled byte (proto/README §2.4). Agents then keep their
	// sessions on the gRPC stream. Turn it off when something between the
	// agents and this address speaks HTTP/2 or gRPC itself (a gRPC-aware
	// load balancer): the agents would fall back each time anyway.
	DisableDataLane bool `json:"disable_data_lane,omitempty"`

	// DisableDirectSockets stops offering agents direct sockets: with a
	// data lane, a connection that carried 1 MiB moves to a socket of its
	// own from the agent to the control address, which Caddy reads
	// straight into its buffers instead of out of the lane's
	// (proto/README §2.5). Each bulk connection then holds one more file
	// descriptor at both ends. Without a data lane there are none either.
	DisableDirectSockets bool `json:"disable_direct_sockets,omitempty"`

	// NodeID is the `node` label of every metric this node reports into
	// Caddy's metrics registry, so series from several nodes stay apart
	// once scraped together, the node_id field of its log lines, and its
	// id among the members of a cluster. Default: the host name; required
	// with Cluster.
	NodeID string `json:"node_id,omitempty"`

	// Warmup keeps readiness (/sluice/ready, `sluice_health ready`) down
	// this long after the control plane started serving, so agents connect
	// before a load balancer sends the node traffic. A reload does not
	// start it again. Default 0: none.
	Warmup caddy.Duration `json:"warmup,omitempty"`

	// Cluster makes the node one of several that every agent connects to
	// (see Cluster). Default: none; agents are told of no other node.
	Cluster *Cluster `json:"cluster,omitempty"`

	// UDPOptions: claimed UDP ports and datagram flow limits
	// (udp_options.go).
	UDPOptions

	token     string         // the unscoped token; "": none
	creds     *credentialSet // every credential, the token's included
	ctls      *controlTLS    // the control plane's TLS; nil: plaintext
	portRange portRange
	udpOpts   udpNodeOptions
	node      *node
	members   *membership                  // the cluster's; nil: none
	listen    func() (net.Listener, error) // binds the control address (node.serve)
	logger    *zap.Logger

	applied *nodeOptions // the options Start gave the node
	prev    nodeSettings // what the node had before Start
}

// nodeSettings is what a config's Start hands the shared node, kept so a
// rolled-back start can give the previous config's back.
type nodeSettings struct {
	creds         *credentialSet
	ctls          *controlTLS
	logger        *zap.Logger
	budget, slots int64
	opts          *nodeOptions
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "sluice",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision resolves the token and takes (or creates) the node for the
// control address.
func (a *App) Provision(ctx caddy.Context) error {
	if err := a.provisionCluster(); err != nil {
		return err
	}
	if a.NodeID == "" {
		a.NodeID = defaultNodeID()
	}
	// Every line the node logs names it: several nodes' logs are often
	// read together.
	a.logger = ctx.Logger().With(zap.String("node_id", a.NodeID))
	if a.Listen == "" {
		a.Listen = DefaultListen
	}
	if a.AdvertiseTimeout == 0 {
		a.AdvertiseTimeout = caddy.Duration(10 * time.Second)
	}
	if a.MaxSessions == 0 {
		a.MaxSessions = DefaultMaxSessions
	}
	if a.MaxPendingStreams == 0 {
		a.MaxPendingStreams = 256
	}
	if a.MaxPendingStreamsPerAddress == 0 {
		a.MaxPendingStreamsPerAddress = 16
	}
	if a.TunnelStallTimeout == 0 {
		a.TunnelStallTimeout = caddy.Duration(tunnelcore.DefaultStallTimeout)
	}
	if a.DrainGrace == 0 {
		a.DrainGrace = caddy.Duration(10 * time.Second)
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	token, err := a.resolveToken()
	if err != nil {
		return err
	}
	a.token = token
	if err := a.provisionCredentials(); err != nil {
		return err
	}
	if token != "" && len(token) < minTokenLength {
		a.logger.Warn("sluice: the token is short; anyone who guesses it can serve any host through this node",
			zap.Int("length", len(token)), zap.Int("recommended_min", minTokenLength))
	}
	if a.portRange, err = parsePortList("tcp_port_range", a.TCPPortRange); err != nil {
		return fmt.Errorf("sluice: %w", err)
	}
	if a.udpOpts, err = a.UDPOptions.provision(); err != nil {
		return err
	}
	na, err := caddy.ParseNetworkAddress(a.Listen)
	if err != nil {
		return fmt.Errorf("sluice: listen: %w", err)
	}
	if na.PortRangeSize() != 1 {
		return fmt.Errorf("sluice: listen: %q must be a single port", a.Listen)
	}
	if !na.IsUnixNetwork() && na.StartPort == 0 && !strings.HasSuffix(a.Listen, ":0") {
		// "localhost" parses as port 0: a random port no agent would find.
		return fmt.Errorf("sluice: listen: %q has no port (as in :8001)", a.Listen)
	}
	if err := checkTCPBind(a.TCPBind, a.TCPPortRange); err != nil {
		return err
	}
	if a.ctls, err = a.loadControlTLS(ctx, na); err != nil {
		return err
	}
	// The node is shared by every config naming the address; it listens
	// from the first Start on (listen), not here: `caddy validate`
	// provisions a config without starting it, and must neither bind the
	// port nor take agents' connections.
	val, _, err := nodePool.LoadOrNew(nodeKey(na.String()), func() (caddy.Destructor, error) {
		return newNode(na.String(), a.ctls, a.logger), nil
	})
	if err != nil {
		return err
	}
	a.listen = func() (net.Listener, error) { return a.listenControl(ctx, na) }
	a.node = val.(*node) // Cleanup releases it, also when Provision fails below
	if a.node.tls != (a.ctls != nil) {
		return fmt.Errorf("sluice: tls_cert_file/tls_internal: the control plane on %s is already listening %s; "+
			"turning TLS on or off needs a new listener (restart Caddy, or use another listen address)",
			a.node.addr, map[bool]string{true: "with TLS", false: "in plaintext"}[a.node.tls])
	}
	return nil
}

// Validate checks the configuration.
func (a *App) Validate() error {
	if (a.TLSCertFile == "") != (a.TLSKeyFile == "") {
		return errors.New("sluice: tls_cert_file and tls_key_file must be set together")
	}
	if a.AdvertiseTimeout < 0 {
		return errors.New("sluice: advertise_timeout must not be negative")
	}
	if a.VerbatimIdleTimeout < 0 {
		return errors.New("sluice: verbatim_idle_timeout must not be negative")
	}
	for name, v := range map[string]int64{
		"max_connections": a.MaxConnections, "connection_memory": a.ConnectionMemory,
		"max_connections_per_address": int64(a.MaxConnectionsPerAddress), "tunnel_budget": a.TunnelBudget,
		"max_sessions": int64(a.MaxSessions), "max_sessions_per_address": int64(a.MaxSessionsPerAddress),
		"max_pending_streams": int64(a.MaxPendingStreams), "max_pending_streams_per_address": int64(a.MaxPendingStreamsPerAddress),
		"drain_grace": int64(a.DrainGrace), "warmup": int64(a.Warmup),
	} {
		if v < 0 {
			return fmt.Errorf("sluice: %s must not be negative", name)
		}
	}
	return nil
}

// loadCertificate reads the control plane's key pair; nil without one.
func (a *App) loadCertificate() (*tls.Certificate, error) {
	if a.TLSCertFile == "" && a.TLSKeyFile == "" {
		return nil, nil
	}
	if a.TLSCertFile == "" || a.TLSKeyFile == "" {
		return nil, errors.New("sluice: tls_cert_file and tls_key_file must be set together")
	}
	cert, err := tls.LoadX509KeyPair(a.TLSCertFile, a.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("sluice: tls_cert_file/tls_key_file: %w", err)
	}
	return &cert, nil
}

// DefaultMaxSessions is the default of max_sessions.
const DefaultMaxSessions = 1024

// minTokenLength is the shortest token accepted without a warning: 128
// bits as hex. A generated token has 64 hex characters.
const minTokenLength = 32

// resolveToken returns the configured token, or the generated one.
func (a *App) resolveToken() (string, error) {
	switch {
	case a.Token != "" && a.TokenFile != "":
		return "", errors.New("sluice: token and token_file are mutually exclusive")
	case a.Token != "":
		// Trimmed and checked as the agent does, so that a token no agent
		// can send fails here, not at every agent's connect.
		t := ident.TrimToken(a.Token)
		if err := ident.CheckToken(t); err != nil {
			return "", fmt.Errorf("sluice: token: %w", err)
		}
		return t, nil
	case a.TokenFile != "":
		b, err := os.ReadFile(a.TokenFile)
		if err != nil {
			return "", fmt.Errorf("sluice: token_file: %w", err)
		}
		t := ident.TrimToken(string(b)) // as the agent reads the same file
		if t == "" {
			return "", fmt.Errorf("sluice: token_file: %s is empty", a.TokenFile)
		}
		if err := ident.CheckToken(t); err != nil {
			return "", fmt.Errorf("sluice: token_file: %s: %w (one line: the token)", a.TokenFile, err)
		}
		return t, nil
	case len(a.Credentials) > 0 || a.ClientAuth != nil:
		// Named credentials or certificates: an unscoped token the
		// operator did not ask for would be the key to every host.
		return "", nil
	}
	return a.generatedToken()
}

// generatedToken reads the token generated earlier, or makes one.
func (a *App) generatedToken() (string, error) {
	path := filepath.Join(caddy.AppDataDir(), "sluice", "token")
	if b, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(b)) != "" {
		a.logger.Info("sluice: no token configured; using the generated token", zap.String("token_file", path))
		return strings.TrimSpace(string(b)), nil
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("sluice: reading generated token: %w", err)
	}
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	token := hex.EncodeToString(raw)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", fmt.Errorf("sluice: storing generated token: %w", err)
	}
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("sluice: storing generated token: %w", err)
	}
	a.logger.Warn("sluice: no token configured; generated one for agents", zap.String("token_file", path))
	return token, nil
}

// listenControl binds the control address; the node calls it once, when it
// starts serving.
func (a *App) listenControl(ctx caddy.Context, na caddy.NetworkAddress) (net.Listener, error) {
	lnAny, err := na.Listen(ctx, 0, net.ListenConfig{})
	if err != nil {
		return nil, fmt.Errorf("sluice: listen %s: %w", a.Listen, err)
	}
	ln, ok := lnAny.(net.Listener)
	if !ok {
		return nil, fmt.Errorf("sluice: listen: %s is not a stream address", a.Listen)
	}
	a.logger.Info("sluice control plane listening", zap.String("address", ln.Addr().String()), zap.Bool("tls", a.ctls != nil),
		zap.Bool("client_auth", a.ClientAuth != nil))
	if a.ctls == nil && reachableBeyondHost(ln.Addr()) {
		// Said once per listener, not per reload.
		a.logger.Warn("the sluice control plane serves plaintext beyond loopback: agents' tokens cross the network in the clear; give the global sluice block a tls certificate (agents dial grpcs://) unless the network is trusted",
			zap.String("address", ln.Addr().String()))
	}
	return ln, nil
}

// Start hands this config's settings to the shared node, and starts it
// serving if this is the first config that uses it.
func (a *App) Start() error {
	a.prev = nodeSettings{
		creds: a.node.creds.Load(), ctls: a.node.ctls.Load(), logger: a.node.logger.Load(),
		budget: a.node.budget.Limit(), slots: a.node.slots.Limit(),
	}
	// Sessions that authenticated with a previous credential end only
	// once this config has taken over (the previous config's Stop): a
	// start rolled back keeps them. New streams need these credentials
	// from now on.
	a.node.creds.Store(a.creds)
	a.node.ctls.Store(a.ctls)
	a.node.logger.Store(a.logger)
	lim := tunnelcore.DeriveLimits(tunnelcore.MemoryLimit(), a.TunnelBudget, a.ConnectionMemory, a.MaxConnections)
	a.node.budget.SetLimit(lim.Budget)
	a.node.slots.SetLimit(lim.MaxConnections)
	a.logger.Info("sluice limits",
		zap.Int64("memory_limit", lim.Memory), zap.Int64("tunnel_budget", lim.Budget),
		zap.Int64("connection_memory", lim.ConnMemory), zap.Int64("max_connections", lim.MaxConnections),
		zap.Int("max_connections_per_address", a.MaxConnectionsPerAddress),
		zap.Int("max_sessions", a.MaxSessions), zap.Int("max_pending_streams", a.MaxPendingStreams))
	a.applied = &nodeOptions{
		maxConnsPerAddr:     a.MaxConnectionsPerAddress,
		maxSessions:         a.MaxSessions,
		maxSessionsPerAddr:  a.MaxSessionsPerAddress,
		maxPending:          a.MaxPendingStreams,
		maxPendingPerAddr:   a.MaxPendingStreamsPerAddress,
		stallTimeout:        time.Duration(a.TunnelStallTimeout),
		drainGrace:          time.Duration(a.DrainGrace),
		advertiseTimeout:    time.Duration(a.AdvertiseTimeout),
		portRange:           a.portRange,
		tcpBind:             a.TCPBind,
		udp:                 a.udpOpts,
		verbatimIdleTimeout: time.Duration(a.VerbatimIdleTimeout),
		noDataLane:          a.DisableDataLane,
		noDirectSockets:     a.DisableDirectSockets,
		nodeID:              a.NodeID,
		warmup:              time.Duration(a.Warmup),
		cluster:             a.members,
	}
	a.prev.opts = a.node.opts.Swap(a.applied)
	a.node.applyPortOptions(a.prev.opts, a.applied)
	if a.members != nil {
		a.logger.Info("sluice cluster", zap.Strings("members", memberIDs(a.members)), zap.Duration("warmup", time.Duration(a.Warmup)))
	}
	return a.node.serve(a.listen)
}

// Stop implements caddy.App. The node keeps running: the next config may
// take it over; Cleanup releases this config's reference.
//
// When this config still owns the node's settings while another config
// holds the node too, its start is being rolled back (another app of the
// config failed to start) and the previous config goes on running: the
// node gets that config's settings back, ports included.
func (a *App) Stop() error {
	if a.node == nil || a.applied == nil {
		return nil
	}
	if refs, _ := nodePool.References(nodeKey(a.node.addr)); refs < 2 {
		return nil // shutdown or unload: no config to hand back to
	}
	if !a.node.opts.CompareAndSwap(a.applied, a.prev.opts) {
		// A newer config took over (a normal reload): it is committed now.
		a.node.applyCredentials()
		a.node.pushMembership()
		return nil
	}
	a.node.creds.Store(a.prev.creds)
	// Ends the sessions only this config's credentials let in, and scopes
	// the others (also those that registered meanwhile) as before.
	a.node.applyCredentials()
	a.node.ctls.Store(a.prev.ctls)
	a.node.logger.Store(a.prev.logger)
	a.node.budget.SetLimit(a.prev.budget)
	a.node.slots.SetLimit(a.prev.slots)
	a.node.applyPortOptions(a.applied, a.prev.opts)
	a.node.pushMembership() // to the sessions that registered under this config's
	a.logger.Info("sluice: start rolled back; the previous configuration's settings are back")
	return nil
}

// Cleanup releases this config's reference to the node; the last one closes
// the control plane.
func (a *App) Cleanup() error {
	if a.node == nil {
		return nil
	}
	_, err := nodePool.Delete(nodeKey(a.node.addr))
	return err
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.Validator    = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)

// reachableBeyondHost reports whether addr is a TCP address other hosts can
// reach: not a loopback IP (a unix socket is not TCP).
func reachableBeyondHost(addr net.Addr) bool {
	ta, ok := addr.(*net.TCPAddr)
	return ok && !ta.IP.IsLoopback()
}

// checkTCPBind refuses a tcp_bind the claimed ports could not bind on, at
// load rather than at each agent's claim, and one without tcp_port_range,
// where it binds nothing.
func checkTCPBind(bind, portRange string) error {
	if bind == "" {
		return nil
	}
	if portRange == "" {
		return fmt.Errorf("sluice: tcp_bind: %q without tcp_port_range binds nothing", bind)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(bind, "0"))
	if err != nil {
		return fmt.Errorf("sluice: tcp_bind: %q: %w", bind, err)
	}
	return ln.Close()
}
