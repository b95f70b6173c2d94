// Package agent is sluice-agent as a library: configuration, one session per node, reconnect with backoff, and the local connector that dials configured upstreams.
package agent

import (
	"bytes"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"go.uber.org/zap/zapcore"
	"gopkg.in/yaml.v3"

	"github.com/sluice-tunnel/sluice/internal/hostname"
	"github.com/sluice-tunnel/sluice/internal/ident"
	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Config is the agent's configuration (YAML file, flags, SLUICE_* environment).
//
// A Config is usable only after Validate succeeded: Validate fills the
// defaults, reads token_file into Token and keeps the parsed forms of the
// server address, the targets and the host patterns.
type Config struct {
	// Server is grpc://host:port (plaintext) or grpcs://host:port (TLS).
	// Required. The agent bootstraps with it: the node it reaches tells
	// the other nodes of its cluster (MembershipUpdate), with which the
	// agent keeps a session each; with ServerEachAddress the addresses of
	// its host are the nodes.
	Server string `yaml:"server"`
	// Insecure (grpcs only) skips verification of the server certificate.
	Insecure bool `yaml:"insecure"`
	// CAFile (grpcs only) is a PEM CA bundle trusted instead of the system roots.
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile (grpcs only, both or neither) are the PEM client
	// certificate and its private key that the agent presents on every TLS
	// connection to the node (control connection, data lane, direct
	// sockets). A node whose control plane verifies client certificates
	// takes the agent's credential from it, so Token becomes optional. The
	// pair is read again before each connection attempt, so a renewed
	// certificate needs no restart.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// Token is the bearer token the agent presents. After Validate it also
	// holds the contents of TokenFile. Printable ASCII without spaces: it
	// travels as a gRPC metadata value ("Bearer <token>").
	Token string `yaml:"token"`
	// TokenFile is read by Validate, trimmed of a leading UTF-8 byte order
	// mark and of surrounding white space, and read again by the agent
	// before each connection attempt, so a rotated token needs no restart.
	// Mutually exclusive with Token. One of them is required unless
	// CertFile is set.
	TokenFile string `yaml:"token_file"`
	// ID is the agent id, printable ASCII without spaces (it travels as a
	// gRPC metadata value); Validate defaults it to "agent-" and 12 random
	// hex digits, different for every Config.
	ID string `yaml:"id"`
	// Upstreams are the local services the agent serves; at least one.
	Upstreams []Upstream `yaml:"upstreams"`
	// MaxConnections limits concurrent virtual connections; 0 means the
	// default (derived by the caller). Must be >= 0.
	MaxConnections int `yaml:"max_connections"`
	// TunnelBudget is the bytes the receive windows above 64 KiB of all
	// the agent's connections may hold; 0 means an eighth of half the
	// memory limit. Must be >= 0.
	TunnelBudget int64 `yaml:"tunnel_budget"`
	// LogLevel is debug, info, warn or error; default info.
	LogLevel string `yaml:"log_level"`
	// ShutdownGrace is how long sluice-agent lets its open connections
	// finish after SIGINT or SIGTERM (Agent.Leave) before it cuts them;
	// a second signal cuts them at once. 0 means DefaultShutdownGrace; at
	// most an hour (tunnelpb.MaxLeaveGrace).
	// Keep it below the time the supervisor waits before it kills the
	// process (docker stop: 10 s, Kubernetes: 30 s, systemd: 90 s).
	// YAML takes Go durations ("30s").
	ShutdownGrace time.Duration `yaml:"shutdown_grace"`
	// DisableDataLane keeps every session on the gRPC stream. By default
	// the agent takes the data lane a node offers: a second connection to
	// the same address that carries the session's frames without HTTP/2
	// framing, which costs both ends less CPU per byte (proto/README §2.4).
	// When the lane cannot be opened (a proxy or load balancer in between
	// that passes only gRPC), the session stays on the gRPC stream by
	// itself; this setting spares that attempt. An HTTPS_PROXY that applies
	// to the server turns the lane off as well.
	DisableDataLane bool `yaml:"disable_data_lane"`
	// DisableDirectSockets keeps every connection on the session's data
	// lane. By default a connection that carried 1 MiB moves to a socket
	// of its own to the node (proto/README §2.5): its bytes then cross no
	// multiplexing at either end, and Caddy reads them straight into its
	// buffers. The cost is one more socket per bulk connection at both
	// ends. Without a data lane there are no direct sockets either.
	DisableDirectSockets bool `yaml:"disable_direct_sockets"`
	// AdminListen is the host:port of the agent's admin listener, which
	// serves /metrics (Prometheus), /healthz, /readyz and /status (JSON);
	// empty (the default) serves none. Flag -admin-listen, environment
	// SLUICE_ADMIN_LISTEN. It answers without authentication and tells
	// the agent's routes and state, so keep it on loopback
	// (127.0.0.1:9001) or a private network: the agent warns when it
	// binds beyond loopback.
	AdminListen string `yaml:"admin_listen"`
	// ServerEachAddress makes the agent resolve the host of Server and
	// keep a session with every address it resolves to (the same port;
	// for grpcs:// the TLS server name stays the host name), so that a
	// DNS name listing a cluster's nodes is the cluster's membership. The
	// name is resolved again every ServerRefresh: the agent opens sessions
	// with the new addresses and leaves the sessions with the addresses
	// gone, as it leaves on shutdown. The nodes' MembershipUpdates are
	// then logged and not used. Flag -server-each-address, environment
	// SLUICE_SERVER_EACH_ADDRESS.
	ServerEachAddress bool `yaml:"server_each_address"`
	// ServerRefresh is how often ServerEachAddress resolves the host
	// again; 0 means DefaultServerRefresh, at least MinServerRefresh.
	// Flag -server-refresh, environment SLUICE_SERVER_REFRESH. YAML takes
	// Go durations ("30s").
	ServerRefresh time.Duration `yaml:"server_refresh"`
	// KeepaliveTime is the interval of the gRPC keepalive pings the agent
	// sends on its connection to each node, which tell a dead node (or a
	// middlebox that dropped the connection) from an idle one. 0 means
	// DefaultKeepaliveTime (30s); at least MinKeepaliveTime (10s): a node
	// answers pings more frequent than its enforcement policy permits
	// (sluice's nodes permit one per 10s) with GOAWAY too_many_pings, which
	// ends the session, and gRPC's client never pings more often anyway.
	// A data lane is watched by TCP keepalive besides. Flag
	// -keepalive-time, environment SLUICE_KEEPALIVE_TIME. YAML takes Go
	// durations ("30s").
	KeepaliveTime time.Duration `yaml:"keepalive_time"`
	// KeepaliveTimeout is how long the answer to a keepalive ping may
	// take before the connection to the node is torn down (the agent then
	// reconnects). 0 means DefaultKeepaliveTimeout (10s); at least
	// MinKeepaliveTimeout (1s). Flag -keepalive-timeout, environment
	// SLUICE_KEEPALIVE_TIMEOUT.
	KeepaliveTimeout time.Duration `yaml:"keepalive_timeout"`
	// TunnelStallTimeout is how long a session may hold frames queued for
	// the node, with the node taking none of them (it stopped reading the
	// stream while still answering keepalives), before the agent cancels
	// the session and reconnects; a link that still moves 16 KiB per
	// timeout is not cut (tunnelcore.Config.StallTimeout). 0 means
	// DefaultTunnelStallTimeout (60s); negative turns the watchdog off (as
	// the node's tunnel_stall_timeout). Flag -tunnel-stall-timeout,
	// environment SLUICE_TUNNEL_STALL_TIMEOUT.
	TunnelStallTimeout time.Duration `yaml:"tunnel_stall_timeout"`

	serverTLS  bool   // parsed Server: grpcs
	serverAddr string // parsed Server: host:port
	// tokenFrom and tokenRead record the TokenFile whose contents Validate
	// put in Token, so that a second Validate does not mistake them for a
	// conflicting token.
	tokenFrom, tokenRead string
}

// Upstream is one local service the agent serves through the tunnel.
type Upstream struct {
	// Name is the stable route name. Default: Host, HostPattern,
	// ":<listen_port>", or "*" for the catch-all upstream. A tcp://
	// upstream with a name and no host, host pattern or listen port is a
	// named service: layer4's `sluice NAME` reaches it, HTTP never does.
	// A udp:// upstream is reached by its name (a layer4 UDP server's
	// `sluice NAME`) or its listen port, and needs one of them.
	Name string `yaml:"name"`
	// Host is an exact host name or IP address, without port, lowercased
	// by Validate, which also removes the brackets around an IPv6 address
	// (the node matches hosts without them). "*" is accepted as the
	// catch-all and normalised to "".
	Host string `yaml:"host"`
	// HostPattern is an RE2 regexp that must match the whole host name.
	// The node matches it against the lower-cased host, so it must be lower
	// case unless it starts with (?i).
	HostPattern string `yaml:"host_pattern"`
	// Target is http://host:port, https://host:port, tcp://host:port or
	// udp://host:port; host:port alone (127.0.0.1:8080, localhost:3000)
	// means http://host:port. Validate rewrites it as scheme://host:port
	// with a lower-case scheme, the form the node is sent. A route served
	// in-process (Listen) dials nothing: its target is empty (HTTP), or
	// http:// or tcp:// to say what the node sends it. A udp:// upstream gets
	// each client address's datagrams in a flow of its own, which the
	// agent relays over a UDP socket of its own to the target (so replies
	// go back to that client alone).
	Target string `yaml:"target"`
	// RewriteHost is the Host header the upstream expects; empty keeps the
	// client's. Routes that take HTTP only (not listen_port,
	// tls_passthrough or a named tcp:// service).
	RewriteHost string `yaml:"rewrite_host"`
	// InsecureSkipVerify (https targets only) skips verification of the
	// upstream's certificate.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify"`
	// TLSPassthrough routes raw TLS by SNI; requires Host or HostPattern and
	// a tcp:// target.
	TLSPassthrough bool `yaml:"tls_passthrough"`
	// ListenPort (1..65535) asks the node to bind this TCP port and relay it
	// verbatim (a tcp:// target), or this UDP port and carry its datagrams
	// (a udp:// target); excludes Host, HostPattern and TLSPassthrough.
	ListenPort int `yaml:"listen_port"`
	// ProxyProtocol is "", "v1" or "v2" (tcp:// targets only): the PROXY
	// protocol header the agent sends to the upstream.
	ProxyProtocol string `yaml:"proxy_protocol"`
	// ForceHTTP1 marks an upstream that speaks HTTP/1.1 only (http://, or
	// a tcp:// route reached by host that Caddy speaks HTTP or TLS to):
	// Caddy's sluice transport uses HTTP/1.1 for this route even when its
	// versions enable h2c or HTTP/2. It is always advertised for https://
	// targets: the agent speaks to them over HTTP/1.1 (ALPN http/1.1)
	// because the node chooses the HTTP version before the agent's TLS
	// handshake could tell which one the upstream speaks. An HTTP/2-only
	// TLS upstream, such as gRPC over TLS, is therefore not supported
	// through an https:// target.
	ForceHTTP1 bool `yaml:"force_http1"`
	// AllowedCIDRs are the client prefixes allowed on this route; empty
	// allows all. Validate rewrites them in canonical form.
	AllowedCIDRs []string `yaml:"allowed_cidrs"`
	// VerbatimIdleTimeout closes a verbatim-relayed connection idle this
	// long; 0 keeps the node's default, otherwise at least 1ms (the wire
	// carries milliseconds). YAML takes Go durations ("30s").
	VerbatimIdleTimeout time.Duration `yaml:"verbatim_idle_timeout"`
	// UDPIdleTimeout ends a udp:// upstream's flow (and closes its
	// socket) after this long without a datagram either way; the node is
	// told it too. 0: 60 s; otherwise at least 1ms.
	UDPIdleTimeout time.Duration `yaml:"udp_idle_timeout"`

	scheme   string         // parsed Target: http, https, tcp or udp
	hostport string         // parsed Target: host:port
	pattern  *regexp.Regexp // compiled ^(?:HostPattern)$
	// patternInsts is the size of pattern's program (hostname.CompilePattern).
	patternInsts int
	prefixes     []netip.Prefix // parsed AllowedCIDRs
	// kind is route.Classify's kind of the route the upstream is
	// advertised as, decided by Validate (Kind).
	kind route.Kind
	// origin names where the upstream came from when not the config
	// file ("SLUICE_UPSTREAMS[1]", "-upstream[0]"), for Validate's
	// errors: the merged list's index is in no source the user wrote.
	origin string
	// schemeless records a Target written without a scheme (read as
	// http://), for the errors of the options that want another one.
	schemeless bool
	// local, when set, serves the route in-process: the connector hands
	// its connections to this Listener (Listen) instead of dialing Target.
	local *Listener
}

// field is the upstream's name in Validate's errors: its source, else its
// index (the config file's upstreams come first, so the index is theirs).
func (u *Upstream) field(i int) string {
	if u.origin != "" {
		return u.origin
	}
	return fmt.Sprintf("upstreams[%d]", i)
}

// readTokenFile reads and checks the token in path. The token itself is
// never quoted in the error: it is a secret.
func readTokenFile(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tok := ident.TrimToken(string(data))
	if tok == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	if err := ident.CheckToken(tok); err != nil {
		return "", fmt.Errorf("%s: the token %w", path, err)
	}
	return tok, nil
}

// ServerAddr returns the parsed Server (valid after Validate): whether to use
// TLS (grpcs) and the host:port to dial.
func (c *Config) ServerAddr() (useTLS bool, hostport string) {
	return c.serverTLS, c.serverAddr
}

// ZapLevel returns LogLevel as a zap level (info when unset or invalid).
func (c *Config) ZapLevel() zapcore.Level {
	var l zapcore.Level
	if err := l.UnmarshalText([]byte(strings.ToLower(c.LogLevel))); err != nil || c.LogLevel == "" {
		return zapcore.InfoLevel
	}
	return l
}

// TargetURL returns the parsed Target (valid after Validate): scheme is
// "http", "https", "tcp" or "udp" and hostport is the address to dial.
func (u Upstream) TargetURL() (scheme, hostport string) {
	return u.scheme, u.hostport
}

// Pattern returns HostPattern compiled as ^(?:pattern)$, or nil when the
// upstream has no host pattern (or, before Validate, an invalid one).
func (u Upstream) Pattern() *regexp.Regexp {
	if u.pattern != nil || u.HostPattern == "" {
		return u.pattern
	}
	re, err := compilePattern(u.HostPattern)
	if err != nil {
		return nil
	}
	return re
}

// Prefixes returns the parsed AllowedCIDRs (valid after Validate).
func (u Upstream) Prefixes() []netip.Prefix {
	return u.prefixes
}

// Kind returns the upstream's kind of route, as the node classifies the
// route it is advertised as (valid after Validate; route.Invalid before,
// or for an upstream Validate rejected).
func (u Upstream) Kind() route.Kind {
	return u.kind
}

// IsCatchAll reports whether the upstream takes every HTTP host no other
// upstream matches (valid after Validate): no host, no host pattern and no
// listen port, and either an http:// or https:// target or the name "*"
// (host '*'). A tcp:// upstream with a name and none of them is a named
// service (see IsNamedService).
func (u Upstream) IsCatchAll() bool {
	return u.kind == route.CatchAll
}

// IsNamedService reports whether the upstream is a raw TCP service reached
// by its name only (layer4's `sluice NAME`), never by HTTP (valid after
// Validate): a tcp:// target, no host, host pattern or listen port, and a
// name other than "*".
func (u Upstream) IsNamedService() bool {
	return u.kind == route.NamedTCP
}

// isTCP reports whether the target is tcp://, before Validate parsed it
// too.
func (u Upstream) isTCP() bool {
	return u.scheme == "tcp" || strings.HasPrefix(strings.ToLower(strings.TrimSpace(u.Target)), "tcp://")
}

// isUDP reports whether the target is udp://, before Validate parsed it
// too.
func (u Upstream) isUDP() bool {
	return u.scheme == "udp" || strings.HasPrefix(strings.ToLower(strings.TrimSpace(u.Target)), "udp://")
}

// compilePattern compiles a host pattern as the node does, within the
// node's bounds (internal/hostname).
func compilePattern(p string) (*regexp.Regexp, error) {
	re, _, err := hostname.CompilePattern(p)
	return re, err
}

// LoadFile reads a YAML configuration file. Unknown fields are rejected. The
// result is not validated: merge the environment and flags, then call Validate.
func LoadFile(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	c, err := parseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return c, nil
}

// parseConfig reads one YAML document of Config fields (none: an empty
// Config); unknown fields are errors.
func parseConfig(data []byte) (*Config, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	c := new(Config)
	if err := dec.Decode(c); err != nil {
		if errors.Is(err, io.EOF) {
			return c, nil // empty file
		}
		return nil, explainYAML(data, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, errors.New("more than one YAML document")
	}
	return c, nil
}

// explainYAML rewrites the type errors of yaml.v3, which give a line and a
// Go type ("line 3: cannot unmarshal !!int `30` into time.Duration"), to
// name the field and what it takes ("shutdown_grace (line 3): `30` is not
// a duration (as in 30s)"). Other errors pass unchanged.
func explainYAML(data []byte, err error) error {
	var te *yaml.TypeError
	if !errors.As(err, &te) {
		return err
	}
	var doc yaml.Node
	if yaml.Unmarshal(data, &doc) != nil {
		return err
	}
	fields := map[int]string{} // line -> path of the field set there
	if !yamlFields(&doc, "", fields) {
		return err // aliases: yaml.v3 reports the anchor's line
	}
	var msgs []string
	for _, e := range te.Errors {
		msgs = append(msgs, explainYAMLLine(e, fields))
	}
	return errors.New(strings.Join(msgs, "; "))
}

// The shapes of the yaml.v3 errors explainYAML rewrites, and the names of
// the Go types a field takes.
var (
	yamlLine      = regexp.MustCompile(`^line (\d+): (.*)$`)
	yamlCannot    = regexp.MustCompile("^cannot unmarshal !!\\w+ (`.*`) into (.+)$")
	yamlNotFound  = regexp.MustCompile(`^field (\S+) not found in type \S+$`)
	yamlTypeNames = map[string]string{
		"time.Duration": "a duration (as in 30s)", "int": "an integer", "int64": "an integer",
		"bool": "true or false", "string": "a string", "[]string": "a list of strings",
	}
)

func explainYAMLLine(e string, fields map[int]string) string {
	m := yamlLine.FindStringSubmatch(e)
	if m == nil {
		return e
	}
	line, _ := strconv.Atoi(m[1])
	msg := m[2]
	path, ok := fields[line] // "" when several fields share the line
	if nf := yamlNotFound.FindStringSubmatch(msg); nf != nil {
		if !ok || path == "" || !strings.HasSuffix(path, nf[1]) {
			path = nf[1]
		}
		return fmt.Sprintf("%s (line %d): unknown field", path, line)
	}
	if path == "" {
		return e
	}
	if c := yamlCannot.FindStringSubmatch(msg); c != nil {
		want, known := yamlTypeNames[c[2]]
		if !known {
			want = "a " + c[2]
		}
		return fmt.Sprintf("%s (line %d): %s is not %s", path, line, c[1], want)
	}
	return fmt.Sprintf("%s (line %d): %s", path, line, msg)
}

// yamlFields records, for each line of n that sets one field, the field's
// path in the config's terms ("upstreams[1].target"), and "" for a line
// that sets several (flow style). It reports false for a document with
// aliases, whose errors yaml.v3 reports at the anchor.
func yamlFields(n *yaml.Node, path string, fields map[int]string) bool {
	set := func(line int, p string) {
		if q, taken := fields[line]; taken && q != p && !strings.HasPrefix(p, q) {
			p = ""
		}
		fields[line] = p
	}
	switch n.Kind {
	case yaml.AliasNode:
		return false
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if !yamlFields(c, path, fields) {
				return false
			}
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := k.Value
			if path != "" {
				p = path + "." + k.Value
			}
			set(k.Line, p)
			if v.Line != k.Line {
				set(v.Line, p)
			}
			if !yamlFields(v, p, fields) {
				return false
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			if c.Kind != yaml.MappingNode {
				set(c.Line, p)
			}
			if !yamlFields(c, p, fields) {
				return false
			}
		}
	}
	return true
}

// Environment variables read by ApplyEnv (and SLUICE_CONFIG by ParseFlags).
const (
	EnvConfig         = "SLUICE_CONFIG"
	EnvServer         = "SLUICE_SERVER"
	EnvToken          = "SLUICE_TOKEN"
	EnvTokenFile      = "SLUICE_TOKEN_FILE"
	EnvID             = "SLUICE_ID"
	EnvInsecure       = "SLUICE_INSECURE"
	EnvCAFile         = "SLUICE_CA_FILE"
	EnvCertFile       = "SLUICE_CERT_FILE"
	EnvKeyFile        = "SLUICE_KEY_FILE"
	EnvLogLevel       = "SLUICE_LOG_LEVEL"
	EnvMaxConnections = "SLUICE_MAX_CONNECTIONS"
	EnvUpstreams      = "SLUICE_UPSTREAMS"
	EnvTunnelBudget   = "SLUICE_TUNNEL_BUDGET"
	EnvShutdownGrace  = "SLUICE_SHUTDOWN_GRACE"
	EnvDisableLane    = "SLUICE_DISABLE_DATA_LANE"
	EnvDisableDirect  = "SLUICE_DISABLE_DIRECT_SOCKETS"
	EnvAdminListen    = "SLUICE_ADMIN_LISTEN"
	EnvServerEach     = "SLUICE_SERVER_EACH_ADDRESS"
	EnvServerRefresh  = "SLUICE_SERVER_REFRESH"
	EnvKeepaliveTime  = "SLUICE_KEEPALIVE_TIME"
	EnvKeepaliveTO    = "SLUICE_KEEPALIVE_TIMEOUT"
	EnvStallTimeout   = "SLUICE_TUNNEL_STALL_TIMEOUT"
)

// ApplyEnv overrides c with the SLUICE_* variables that getenv reports
// non-empty. SLUICE_UPSTREAMS holds semicolon-separated upstream specs (the
// -upstream syntax, see ParseUpstream); they are appended to c.Upstreams.
// Setting only one of SLUICE_TOKEN and SLUICE_TOKEN_FILE replaces both
// token settings of the file.
func (c *Config) ApplyEnv(getenv func(string) string) error {
	if getenv == nil {
		getenv = os.Getenv
	}
	var errs []error
	setStr := func(name string, dst *string) {
		if v := getenv(name); v != "" {
			*dst = v
		}
	}
	setStr(EnvID, &c.ID)
	setStr(EnvLogLevel, &c.LogLevel)
	setStr(EnvAdminListen, &c.AdminListen)
	c.setToken(getenv(EnvToken), getenv(EnvTokenFile))
	// envBool is the boolean in variable name, nil when it is unset or
	// invalid (an error then).
	envBool := func(name string) *bool {
		v := getenv(name)
		if v == "" {
			return nil
		}
		b, err := strconv.ParseBool(strings.TrimSpace(v))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: invalid boolean %q", name, v))
			return nil
		}
		return &b
	}
	insecure := envBool(EnvInsecure)
	c.setServer(nonEmpty(getenv(EnvServer)), insecure, nonEmpty(getenv(EnvCAFile)))
	c.setClientCert(nonEmpty(getenv(EnvCertFile)), nonEmpty(getenv(EnvKeyFile)))
	if v := getenv(EnvMaxConnections); v != "" {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: invalid integer %q", EnvMaxConnections, v))
		} else {
			c.MaxConnections = n
		}
	}
	if v := getenv(EnvTunnelBudget); v != "" {
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: invalid integer %q", EnvTunnelBudget, v))
		} else {
			c.TunnelBudget = n
		}
	}
	envDuration := func(name string, dst *time.Duration) {
		if v := getenv(name); v != "" {
			d, err := time.ParseDuration(strings.TrimSpace(v))
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: invalid duration %q", name, v))
			} else {
				*dst = d
			}
		}
	}
	envDuration(EnvShutdownGrace, &c.ShutdownGrace)
	envDuration(EnvServerRefresh, &c.ServerRefresh)
	envDuration(EnvKeepaliveTime, &c.KeepaliveTime)
	envDuration(EnvKeepaliveTO, &c.KeepaliveTimeout)
	envDuration(EnvStallTimeout, &c.TunnelStallTimeout)
	if b := envBool(EnvDisableLane); b != nil {
		c.DisableDataLane = *b
	}
	if b := envBool(EnvDisableDirect); b != nil {
		c.DisableDirectSockets = *b
	}
	if b := envBool(EnvServerEach); b != nil {
		c.ServerEachAddress = *b
	}
	if v := getenv(EnvUpstreams); v != "" {
		k := 0
		for _, spec := range strings.Split(v, ";") {
			if strings.TrimSpace(spec) == "" {
				continue
			}
			u, err := ParseUpstream(spec)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", EnvUpstreams, err))
				continue
			}
			u.origin = fmt.Sprintf("%s[%d]", EnvUpstreams, k)
			k++
			c.Upstreams = append(c.Upstreams, u)
		}
	}
	return errors.Join(errs...)
}

// setToken applies one configuration layer's token settings: a layer that
// sets only one of them replaces both settings of the layers below; a layer
// that sets both keeps both (Validate then reports the conflict).
func (c *Config) setToken(token, file string) {
	switch {
	case token != "" && file != "":
		c.Token, c.TokenFile = token, file
	case token != "":
		c.Token, c.TokenFile = token, ""
	case file != "":
		c.Token, c.TokenFile = "", file
	}
	c.tokenFrom, c.tokenRead = "", ""
}

// setServer applies one configuration layer's server and its trust
// settings, which go together as the token's do (setToken). A layer that
// sets a grpc:// server drops the trust settings and the client
// certificate of the layers below (only grpcs:// uses them); one that
// sets insecure, or ca_file, alone replaces the other of the layers below
// (insecure=false keeps a ca_file).
// What one layer sets together stays, for Validate to judge.
// A nil argument is one the layer does not set.
func (c *Config) setServer(server *string, insecure *bool, caFile *string) {
	if server != nil {
		c.Server = *server
		if strings.HasPrefix(strings.ToLower(strings.TrimSpace(*server)), "grpc://") {
			c.Insecure, c.CAFile = false, ""
			c.CertFile, c.KeyFile = "", ""
		}
	}
	switch {
	case insecure != nil && caFile != nil:
		c.Insecure, c.CAFile = *insecure, *caFile
	case insecure != nil:
		c.Insecure = *insecure
		if *insecure {
			c.CAFile = ""
		}
	case caFile != nil:
		c.CAFile = *caFile
		if *caFile != "" {
			c.Insecure = false
		}
	}
}

// setClientCert applies one configuration layer's client certificate
// settings, after its server (setServer). Each file replaces the one of
// the layers below on its own: a renewed certificate often keeps its key,
// and a mismatch is reported by Validate, which loads the pair. A nil
// argument is one the layer does not set.
func (c *Config) setClientCert(certFile, keyFile *string) {
	if certFile != nil {
		c.CertFile = *certFile
	}
	if keyFile != nil {
		c.KeyFile = *keyFile
	}
}

// nonEmpty is a pointer to s, or nil when s is empty (an unset variable).
func nonEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// NewID returns a random agent id: "agent-" and 12 hex digits.
func NewID() string {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("agent: crypto/rand: " + err.Error())
	}
	return "agent-" + hex.EncodeToString(b[:])
}

// DefaultShutdownGrace is the default Config.ShutdownGrace: just under the
// 10 s docker stop waits before it kills, so that the agent cuts what is
// left, logs it and exits by itself.
const DefaultShutdownGrace = 9 * time.Second

// DefaultServerRefresh and MinServerRefresh are the default and the least
// Config.ServerRefresh: a name resolved more often than each second would
// load the resolver for nothing, as membership changes are rare.
const (
	DefaultServerRefresh = 30 * time.Second
	MinServerRefresh     = time.Second
)

// The gRPC keepalive of the connection to each node (Config.KeepaliveTime,
// Config.KeepaliveTimeout). MinKeepaliveTime is the enforcement policy of
// sluice's nodes (keepalive.EnforcementPolicy.MinTime in caddymodule):
// pings more frequent than that are answered with GOAWAY too_many_pings.
const (
	DefaultKeepaliveTime    = 30 * time.Second
	MinKeepaliveTime        = 10 * time.Second
	DefaultKeepaliveTimeout = 10 * time.Second
	MinKeepaliveTimeout     = time.Second
)

// DefaultTunnelStallTimeout is the default Config.TunnelStallTimeout, the
// node's default as well.
const DefaultTunnelStallTimeout = tunnelcore.DefaultStallTimeout

var logLevels = map[string]bool{"debug": true, "info": true, "warn": true, "error": true}

// maxIdleTimeout is the largest VerbatimIdleTimeout the protocol carries
// (uint32 milliseconds).
const maxIdleTimeout = time.Duration(math.MaxUint32) * time.Millisecond

// problems collects Validate's errors, one per problem, each prefixed with
// the path of the field it concerns ("upstreams[1].target: ...").
type problems struct {
	prefix string // "" for the Config, "upstreams[1]." for an upstream
	errs   []error
}

// add records a problem of field (below the prefix).
func (p *problems) add(field, format string, args ...any) {
	p.errs = append(p.errs, fmt.Errorf("%s%s: %s", p.prefix, field, fmt.Sprintf(format, args...)))
}

// Validate normalises c (lowercases hosts and schemes, fills default names,
// ID and log level, reads TokenFile into Token, parses server and targets)
// and checks it. The error joins one error per problem, each prefixed with
// the field it concerns, e.g. "upstreams[1].target: ...". Validate may be
// called again on a validated Config.
func (c *Config) Validate() error {
	var p problems
	c.validateServer(&p)
	c.validateClientCert(&p)
	c.validateToken(&p)
	c.validateID(&p)
	c.validateLimits(&p)
	c.validateAdminListen(&p)
	c.validateUpstreams(&p)
	return errors.Join(p.errs...)
}

// validateServer parses Server and checks the trust settings that go with
// it (grpcs only).
func (c *Config) validateServer(p *problems) {
	c.Server = strings.TrimSpace(c.Server)
	c.serverTLS, c.serverAddr = false, ""
	if c.Server == "" {
		p.add("server", "required")
	} else if scheme, hostport, err := parseURL(c.Server, "grpc or grpcs", "grpc", "grpcs"); err != nil {
		p.add("server", "%v", err)
	} else {
		c.serverTLS, c.serverAddr = scheme == "grpcs", hostport
	}
	if !c.serverTLS && c.serverAddr != "" {
		if c.Insecure {
			p.add("insecure", "only valid with a grpcs:// server")
		}
		if c.CAFile != "" {
			p.add("ca_file", "only valid with a grpcs:// server")
		}
	}
	if c.CAFile != "" {
		if c.Insecure {
			p.add("ca_file", "insecure and ca_file are mutually exclusive")
		}
		if pem, err := os.ReadFile(c.CAFile); err != nil {
			p.add("ca_file", "%v", err)
		} else if !x509.NewCertPool().AppendCertsFromPEM(pem) {
			p.add("ca_file", "%s: no PEM certificate found", c.CAFile)
		}
	}
}

// validateClientCert checks that CertFile and KeyFile come together, with
// a grpcs:// server, and that the pair loads: a typo fails at start naming
// the field rather than at each connection attempt.
func (c *Config) validateClientCert(p *problems) {
	c.CertFile, c.KeyFile = strings.TrimSpace(c.CertFile), strings.TrimSpace(c.KeyFile)
	switch {
	case c.CertFile == "" && c.KeyFile == "":
		return
	case c.KeyFile == "":
		p.add("key_file", "required with cert_file")
		return
	case c.CertFile == "":
		p.add("cert_file", "required with key_file")
		return
	case !c.serverTLS && c.serverAddr != "":
		p.add("cert_file", "only valid with a grpcs:// server")
		return
	}
	if _, err := loadClientCert(c.CertFile, c.KeyFile); err != nil {
		p.errs = append(p.errs, err) // names its field
	}
}

// validateToken reads TokenFile into Token, or checks Token. Without a
// client certificate a token is required; with one, the node takes the
// agent's credential from the certificate.
func (c *Config) validateToken(p *problems) {
	c.Token = ident.TrimToken(c.Token)
	switch {
	case c.TokenFile != "" && c.Token != "" && (c.tokenFrom != c.TokenFile || c.tokenRead != c.Token):
		p.add("token", "token and token_file are mutually exclusive")
	case c.TokenFile != "":
		tok, err := readTokenFile(c.TokenFile)
		if err != nil {
			p.add("token_file", "%v", err)
			return
		}
		c.Token, c.tokenFrom, c.tokenRead = tok, c.TokenFile, tok
	case c.Token == "" && c.CertFile == "" && c.KeyFile == "": // with one of them, its error says what is missing
		p.add("token", "required (set token or token_file, or cert_file and key_file with a grpcs:// server)")
	case c.Token == "":
		// The client certificate authenticates alone.
	default:
		if err := ident.CheckToken(c.Token); err != nil {
			p.add("token", "%v", err)
		}
	}
}

// validateID checks ID, or fills a random one.
func (c *Config) validateID(p *problems) {
	c.ID = strings.TrimSpace(c.ID)
	if c.ID == "" {
		c.ID = NewID()
	} else if err := ident.CheckID(c.ID); err != nil {
		p.add("id", "%v", err)
	}
}

// validateLimits checks the log level, the budgets and the shutdown grace,
// filling their defaults.
func (c *Config) validateLimits(p *problems) {
	c.LogLevel = strings.ToLower(strings.TrimSpace(c.LogLevel))
	if c.LogLevel == "" {
		c.LogLevel = "info"
	} else if !logLevels[c.LogLevel] {
		p.add("log_level", "%q not supported (want debug, info, warn or error)", c.LogLevel)
	}
	if c.TunnelBudget < 0 {
		p.add("tunnel_budget", "must be >= 0, got %d", c.TunnelBudget)
	}
	if c.MaxConnections < 0 {
		p.add("max_connections", "must be >= 0, got %d", c.MaxConnections)
	}
	switch {
	case c.ShutdownGrace < 0:
		p.add("shutdown_grace", "must be >= 0, got %v", c.ShutdownGrace)
	case c.ShutdownGrace == 0:
		c.ShutdownGrace = DefaultShutdownGrace
	case c.ShutdownGrace > tunnelpb.MaxLeaveGrace:
		p.add("shutdown_grace", "at most %v (the node ends a leaving agent's session then), got %v", tunnelpb.MaxLeaveGrace, c.ShutdownGrace)
	}
	switch {
	case c.ServerRefresh == 0:
		c.ServerRefresh = DefaultServerRefresh
	case c.ServerRefresh < MinServerRefresh:
		p.add("server_refresh", "at least %v, got %v", MinServerRefresh, c.ServerRefresh)
	}
	c.validateKeepalive(p)
}

// validateKeepalive checks the keepalive and stall settings, filling their
// defaults.
func (c *Config) validateKeepalive(p *problems) {
	switch {
	case c.KeepaliveTime == 0:
		c.KeepaliveTime = DefaultKeepaliveTime
	case c.KeepaliveTime < MinKeepaliveTime:
		p.add("keepalive_time", "at least %v (a node answers more frequent pings with GOAWAY too_many_pings), got %v", MinKeepaliveTime, c.KeepaliveTime)
	}
	switch {
	case c.KeepaliveTimeout == 0:
		c.KeepaliveTimeout = DefaultKeepaliveTimeout
	case c.KeepaliveTimeout < MinKeepaliveTimeout:
		p.add("keepalive_timeout", "at least %v, got %v", MinKeepaliveTimeout, c.KeepaliveTimeout)
	}
	if c.TunnelStallTimeout == 0 {
		c.TunnelStallTimeout = DefaultTunnelStallTimeout
	}
}

// validateAdminListen checks AdminListen is a host:port to bind, so that
// a typo fails at start naming the field rather than when Run binds it.
func (c *Config) validateAdminListen(p *problems) {
	c.AdminListen = strings.TrimSpace(c.AdminListen)
	if c.AdminListen == "" {
		return
	}
	if err := checkListenAddr(c.AdminListen); err != nil {
		p.add("admin_listen", "%v", err)
	}
}

// checkListenAddr checks addr is host:port with a port number (0 picks
// one) and a host that is empty (all interfaces), an IP address or a
// name.
func checkListenAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port (as in 127.0.0.1:9001): %w", addr, err)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
		return fmt.Errorf("%q: invalid port %q", addr, port)
	}
	if strings.ContainsAny(host, " /") {
		return fmt.Errorf("%q: invalid host %q", addr, host)
	}
	return nil
}

// validateUpstreams checks each upstream, then what a node checks across
// the routes of one Advertise (names, pattern size), and that no two
// upstreams claim the same host, port or catch-all.
func (c *Config) validateUpstreams(p *problems) {
	switch {
	case len(c.Upstreams) == 0:
		p.add("upstreams", "at least one upstream is required")
	case len(c.Upstreams) > tunnelpb.MaxRoutesPerAdvertise:
		p.add("upstreams", "at most %d (a node takes no more routes from one agent), got %d", tunnelpb.MaxRoutesPerAdvertise, len(c.Upstreams))
	}
	s := upstreamSet{c: c, names: map[string]int{}, routes: map[string]int{}}
	for i := range c.Upstreams {
		u := &c.Upstreams[i]
		if errs := u.validate(u.field(i)); len(errs) > 0 {
			p.errs = append(p.errs, errs...)
			continue
		}
		s.add(p, i)
	}
}

// upstreamSet is what validateUpstreams has seen of the upstreams before
// the current one.
type upstreamSet struct {
	c            *Config
	patternInsts int
	names        map[string]int // name -> index
	routes       map[string]int // routeKey -> index
}

// add checks the valid upstream i against the ones before it.
func (s *upstreamSet) add(p *problems, i int) {
	u, ups := &s.c.Upstreams[i], s.c.Upstreams
	field := u.field(i)
	if j, ok := s.names[u.Name]; ok {
		p.add(field+".name", "duplicate name %q (also %s; a name defaults to the host, set name= to tell them apart)", u.Name, ups[j].field(j))
		return
	}
	s.names[u.Name] = i
	if s.patternInsts += u.patternInsts; s.patternInsts > tunnelpb.MaxAdvertisePatternInsts && u.patternInsts > 0 {
		p.add(field+".host_pattern", "the host patterns up to this one compile to %d regexp instructions, more than the %d a node takes from one agent",
			s.patternInsts, tunnelpb.MaxAdvertisePatternInsts)
	}
	if key, what := u.routeKey(); key != "" {
		if j, ok := s.routes[key]; ok {
			p.add(field, "%s already served by %s", what, ups[j].field(j))
		} else {
			s.routes[key] = i
		}
	}
}

// routeKey identifies what the upstream routes, by its kind, to detect two
// upstreams claiming the same host, listen port or catch-all. Patterns may
// overlap, and a named service's name is unique already: they have none.
func (u *Upstream) routeKey() (key, what string) {
	switch u.kind {
	case route.ListenPort:
		return fmt.Sprintf("port:%d", u.ListenPort), fmt.Sprintf("listen_port %d", u.ListenPort)
	case route.UDPListenPort: // a port number is one TCP port and one UDP port
		return fmt.Sprintf("udp-port:%d", u.ListenPort), fmt.Sprintf("udp listen_port %d", u.ListenPort)
	case route.PassthroughHost:
		return "sni:" + u.Host, fmt.Sprintf("tls_passthrough host %q", u.Host)
	case route.Host, route.TCPHost:
		return "host:" + u.Host, fmt.Sprintf("host %q", u.Host)
	case route.CatchAll:
		return "catch-all", "catch-all"
	}
	return "", ""
}

// validate normalises and checks one upstream; field is its path. Each
// step reports its own problems; the kind is decided once the fields it
// depends on (target, host, pattern, name) are normalised.
func (u *Upstream) validate(field string) []error {
	p := problems{prefix: field + "."}
	u.scheme, u.hostport, u.pattern, u.patternInsts, u.prefixes, u.kind = "", "", nil, 0, nil, route.Invalid
	u.schemeless = false
	catchAll := strings.TrimSpace(u.Host) == "*" // before Host is normalised to ""
	u.validateTarget(&p)
	u.validateHost(&p)
	u.validatePattern(&p)
	if u.InsecureSkipVerify && u.scheme != "" && u.scheme != "https" {
		p.add("insecure_skip_verify", "only valid with an https:// target")
	}
	u.validateName(&p, catchAll)
	u.classify(&p)
	u.checkVerbatimTarget(&p)
	if u.ListenPort < 0 || u.ListenPort > 65535 {
		p.add("listen_port", "%d out of range 1..65535", u.ListenPort)
	}
	u.validateProxyProtocol(&p)
	u.validateRewriteHost(&p)
	u.validateCIDRs(&p)
	u.validateIdleTimeout(&p)
	u.validateUDPIdleTimeout(&p)
	return p.errs
}

// validateTarget parses Target and rewrites it in the form the node is
// sent: the node reads the target (tcp:// marks a verbatim route).
func (u *Upstream) validateTarget(p *problems) {
	u.Target = strings.TrimSpace(u.Target)
	if u.local != nil {
		u.validateLocalTarget(p)
		return
	}
	if u.Target != "" && !strings.Contains(u.Target, "//") {
		// host:port alone is the common case of an HTTP upstream, as in
		// the reference and other tunnels; tcp:// and udp:// stay
		// explicit, since they change how the node routes.
		u.Target, u.schemeless = "http://"+u.Target, true
	}
	if u.Target == "" {
		p.add("target", "required")
	} else if scheme, hostport, err := parseURL(u.Target, "http, https, tcp or udp", "http", "https", "tcp", "udp"); err != nil {
		p.add("target", "%v", err)
	} else {
		u.scheme, u.hostport = scheme, hostport
		u.Target = scheme + "://" + hostport
	}
}

// localTarget is the host:port of the Target a route served in-process
// is advertised with: the node reads only the scheme, and logs and the
// status show that nothing is dialed.
const localTarget = "in-process"

// validateLocalTarget checks the Target of a route served in-process
// (Listen): empty (HTTP), or the scheme alone says what the node sends it;
// a host:port after it is ignored, as nothing is dialed.
func (u *Upstream) validateLocalTarget(p *problems) {
	scheme := "http"
	if u.Target != "" {
		s, _, ok := strings.Cut(u.Target, "://")
		if !ok {
			p.add("target", "%q: a route served in-process takes http:// (the default) or tcp://", u.Target)
			return
		}
		scheme = strings.ToLower(s)
	}
	if scheme != "http" && scheme != "tcp" {
		p.add("target", "scheme %q not supported for a route served in-process (want http, the default, or tcp)", scheme)
		return
	}
	u.scheme, u.hostport = scheme, localTarget
	u.Target = scheme + "://" + localTarget
}

// validateHost normalises Host as the node matches hosts: lower case,
// no trailing dot, no brackets; "*" (the catch-all) becomes "".
func (u *Upstream) validateHost(p *problems) {
	u.Host = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(u.Host)), ".")
	if u.Host == "*" {
		u.Host = ""
	}
	if u.Host == "" {
		return
	}
	if h, err := stripBrackets(u.Host); err != nil {
		p.add("host", "%v", err)
	} else if err := hostname.Check(h); err != nil {
		p.add("host", "%v", err)
	} else {
		u.Host = h
	}
}

// validatePattern compiles HostPattern within the node's bounds.
func (u *Upstream) validatePattern(p *problems) {
	if u.HostPattern == "" {
		return
	}
	re, insts, err := hostname.CompilePattern(u.HostPattern)
	switch {
	case err != nil:
		p.add("host_pattern", "%v", err)
	case hostname.UpperCaseLiteral(u.HostPattern) != 0:
		// The node lower-cases hosts before matching: an upper-case
		// letter matched literally never matches.
		p.add("host_pattern", "%q matches %q literally, but hosts are matched lower-cased (write it lower case, or start the pattern with (?i))",
			u.HostPattern, hostname.UpperCaseLiteral(u.HostPattern))
	default:
		u.pattern, u.patternInsts = re, insts
	}
}

// validateName fills the default name (route.Name's rule, as the node
// names a route without one) and checks it. A hostless tcp:// upstream
// has no default: its name is what makes it a named service (route.NamedTCP)
// rather than the catch-all, which host '*' asks for.
func (u *Upstream) validateName(p *problems, catchAll bool) {
	u.Name = strings.TrimSpace(u.Name)
	if u.Name == "" {
		def := route.Name(&tunnelpb.Route{Host: u.Host, HostPattern: u.HostPattern, ListenPort: uint32(u.ListenPort)})
		if def == "*" && u.isTCP() && !catchAll {
			p.add("name", "a tcp:// upstream without host, host_pattern or listen_port is a service reached by its name (layer4's `sluice NAME`): set a name, or host '*' for the HTTP catch-all")
		} else {
			u.Name = def
		}
	} else if catchAll && u.isTCP() && u.Name != "*" {
		// On the wire a hostless tcp:// route named otherwise is a named
		// service, which HTTP never reaches.
		p.add("name", "a tcp:// catch-all (host '*') is named \"*\"; remove name %q, or host to make it a named service", u.Name)
	} else if strings.ContainsFunc(u.Name, func(r rune) bool { return !unicode.IsPrint(r) }) {
		p.add("name", "%q contains control characters", u.Name)
	}
	if len(u.Name) > tunnelpb.MaxRouteNameLength {
		what := "name"
		if u.Name == u.HostPattern {
			what = "name (host_pattern by default; set a shorter name)"
		}
		p.add("name", "%s of %d bytes: the node takes at most %d", what, len(u.Name), tunnelpb.MaxRouteNameLength)
	}
}

// classify decides the upstream's kind as the node will, with
// route.Classify on the fields it is advertised with, and reports the
// fields that make no kind. Without a name (reported already) the kind
// stays unknown: the name tells a named service from the catch-all.
func (u *Upstream) classify(p *problems) {
	kind, err := route.Classify(&tunnelpb.Route{
		Name: u.Name, Host: u.Host, HostPattern: u.HostPattern, Target: u.Target,
		TlsPassthrough: u.TLSPassthrough, ListenPort: uint32(u.ListenPort),
	})
	var invalid *route.InvalidError
	if errors.As(err, &invalid) {
		for _, pr := range invalid.Problems {
			p.add(pr.Field, "%s", pr.Msg)
		}
		return
	}
	if u.Name == "" {
		return
	}
	u.kind = kind
}

// checkVerbatimTarget checks that the fields asking the node to relay
// connections verbatim (by port, or TLS by server name) come with a
// tcp:// target: the connector speaks HTTP to the others. It checks the
// fields, whatever else is wrong with the route. An invalid target is
// reported already.
func (u *Upstream) checkVerbatimTarget(p *problems) {
	if u.scheme == "" || u.scheme == "tcp" || u.scheme == "udp" {
		return // a udp:// route's fields are route.Classify's to check
	}
	why := "requires a tcp:// target"
	if u.schemeless {
		why += " (a target without a scheme means http://)"
	}
	if u.TLSPassthrough {
		p.add("tls_passthrough", "%s", why)
	}
	if u.ListenPort != 0 {
		p.add("listen_port", "%s", why)
	}
}

// takesHTTP reports whether the node speaks HTTP on the upstream's route,
// so that the HTTP options (force_http1, rewrite_host) apply: by its kind,
// and for a route of unknown kind (reported already) by its target.
func (u *Upstream) takesHTTP() bool {
	if u.kind == route.Invalid {
		return !u.isTCP() && !u.isUDP()
	}
	return u.kind.TakesHTTP()
}

// validateProxyProtocol checks the PROXY protocol version (tcp:// only).
func (u *Upstream) validateProxyProtocol(p *problems) {
	u.ProxyProtocol = strings.ToLower(strings.TrimSpace(u.ProxyProtocol))
	switch u.ProxyProtocol {
	case "":
	case "v1", "v2":
		switch {
		case u.local != nil:
			// The header is written to a dialed upstream; a program
			// serving in-process reads the client from RemoteAddr.
			p.add("proxy_protocol", "not valid on a route served in-process (the accepted connection's RemoteAddr is the client)")
		case u.scheme != "" && u.scheme != "tcp":
			p.add("proxy_protocol", "only valid with a tcp:// target")
		}
	default:
		p.add("proxy_protocol", "%q not supported (want v1 or v2)", u.ProxyProtocol)
	}
}

// validateRewriteHost checks the HTTP options: force_http1 and
// rewrite_host apply to a route the node speaks HTTP on (a tcp:// one
// reached by host or as the catch-all included: Caddy may speak TLS to it).
func (u *Upstream) validateRewriteHost(p *problems) {
	const onlyHTTP = "only valid on a route that takes HTTP (not listen_port, tls_passthrough or a named tcp:// service)"
	if u.ForceHTTP1 && !u.takesHTTP() {
		p.add("force_http1", onlyHTTP)
	}
	u.RewriteHost = strings.TrimSpace(u.RewriteHost)
	if u.RewriteHost == "" {
		return
	}
	if !u.takesHTTP() {
		p.add("rewrite_host", onlyHTTP)
	}
	if strings.ContainsFunc(u.RewriteHost, func(r rune) bool { return unicode.IsSpace(r) || r == '/' || !unicode.IsPrint(r) }) {
		p.add("rewrite_host", "%q is not a host[:port]", u.RewriteHost)
	}
}

// validateCIDRs parses AllowedCIDRs and rewrites them in canonical form.
func (u *Upstream) validateCIDRs(p *problems) {
	for j, s := range u.AllowedCIDRs {
		pfx, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			p.add(fmt.Sprintf("allowed_cidrs[%d]", j), "%v", err)
			continue
		}
		if pfx.Addr().Is4In6() && pfx.Bits() >= 96 {
			// Client addresses are compared unmapped (as the node does):
			// an IPv4-mapped prefix would match no one.
			pfx = netip.PrefixFrom(pfx.Addr().Unmap(), pfx.Bits()-96)
		}
		u.AllowedCIDRs[j] = pfx.String()
		u.prefixes = append(u.prefixes, pfx)
	}
}

// validateIdleTimeout checks VerbatimIdleTimeout against what the wire
// carries (whole milliseconds in a uint32).
func (u *Upstream) validateIdleTimeout(p *problems) {
	switch {
	case u.VerbatimIdleTimeout < 0:
		p.add("verbatim_idle_timeout", "must be >= 0, got %v", u.VerbatimIdleTimeout)
	case u.VerbatimIdleTimeout > 0 && u.VerbatimIdleTimeout < time.Millisecond:
		// Less would be sent as 0, the node's default.
		p.add("verbatim_idle_timeout", "must be 0 or at least 1ms, got %v", u.VerbatimIdleTimeout)
	case u.VerbatimIdleTimeout > maxIdleTimeout:
		p.add("verbatim_idle_timeout", "must be at most %v", maxIdleTimeout)
	case u.VerbatimIdleTimeout > 0 && u.scheme != "" && u.scheme != "tcp":
		p.add("verbatim_idle_timeout", "only valid with a tcp:// target")
	}
}

// parseURL parses scheme://host:port with an empty or "/" path; scheme must
// be one of schemes (described by want).
func parseURL(s, want string, schemes ...string) (scheme, hostport string, err error) {
	if !strings.Contains(s, "//") {
		// "127.0.0.1:8001" would otherwise read as scheme "127.0.0.1" or
		// fail inside url.Parse with a message about path segments.
		return "", "", fmt.Errorf("%q has no scheme (want %s, as in %s://host:port)", s, want, schemes[0])
	}
	pu, err := url.Parse(s)
	if err != nil {
		return "", "", fmt.Errorf("invalid URL %q: %v", s, errors.Unwrap(err))
	}
	scheme = strings.ToLower(pu.Scheme)
	switch {
	case scheme == "":
		return "", "", fmt.Errorf("%q has no scheme (want %s)", s, want)
	case !slices.Contains(schemes, scheme):
		return "", "", fmt.Errorf("scheme %q not supported (want %s)", scheme, want)
	case pu.Opaque != "" || pu.Host == "":
		return "", "", fmt.Errorf("%q has no host (want %s://host:port)", s, scheme)
	case pu.User != nil:
		return "", "", fmt.Errorf("%q: user info not allowed", s)
	case pu.Path != "" && pu.Path != "/":
		return "", "", fmt.Errorf("%q: path %q not allowed", s, pu.Path)
	case pu.RawQuery != "" || pu.ForceQuery:
		return "", "", fmt.Errorf("%q: query not allowed", s)
	case pu.Fragment != "":
		return "", "", fmt.Errorf("%q: fragment not allowed", s)
	}
	host, port, err := net.SplitHostPort(pu.Host)
	if err != nil {
		return "", "", fmt.Errorf("%q: port required (want %s://host:port)", s, scheme)
	}
	if host == "" {
		return "", "", fmt.Errorf("%q has no host (want %s://host:port)", s, scheme)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("%q: invalid port %q", s, port)
	}
	return scheme, pu.Host, nil
}

// stripBrackets removes the brackets around an IPv6 address; brackets
// around anything else are an error.
func stripBrackets(h string) (string, error) {
	if !strings.HasPrefix(h, "[") && !strings.HasSuffix(h, "]") {
		return h, nil
	}
	inner := strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
	if a, err := netip.ParseAddr(inner); err != nil || !a.Is6() || len(inner)+2 != len(h) {
		return "", fmt.Errorf("%q: brackets are only allowed around an IPv6 address, without port", h)
	}
	return inner, nil
}

// validateUDPIdleTimeout checks UDPIdleTimeout against what the wire
// carries (whole milliseconds in a uint32), on a udp:// target only.
func (u *Upstream) validateUDPIdleTimeout(p *problems) {
	switch d := u.UDPIdleTimeout; {
	case d < 0:
		p.add("udp_idle_timeout", "must be >= 0, got %v", d)
	case d > 0 && d < time.Millisecond:
		p.add("udp_idle_timeout", "must be 0 or at least 1ms, got %v", d)
	case d > maxIdleTimeout:
		p.add("udp_idle_timeout", "must be at most %v", maxIdleTimeout)
	case d > 0 && u.scheme != "" && u.scheme != "udp":
		p.add("udp_idle_timeout", "only valid with a udp:// target")
	}
}
