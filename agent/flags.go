package agent

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// ErrVersion is returned by ParseFlags for -version: the caller prints the
// version (BuildString) and exits, whatever else the flags say.
var ErrVersion = errors.New("version requested")

// ParseFlags builds the agent's configuration from the command line args
// (without the program name), the environment (getenv; os.Getenv when nil)
// and the configuration file named by -config or SLUICE_CONFIG, then
// validates it. Precedence: file < environment < flags; upstreams from the
// three sources are concatenated in that order.
//
// ParseFlags prints nothing. For -h or -help it returns an error that
// matches flag.ErrHelp (errors.Is) and whose text is the usage; for
// -version, ErrVersion; a flag error is returned as such.
func ParseFlags(args []string, getenv func(string) string) (*Config, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	fs, v := newFlagSet()
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, helpError{}
		}
		return nil, fmt.Errorf("%w (see -h)", err)
	}
	if v.version {
		return nil, ErrVersion
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (see -h)", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	path := getenv(EnvConfig)
	if set["config"] {
		path = v.config
	}
	c := new(Config)
	if path != "" {
		var err error
		if c, err = LoadFile(path); err != nil {
			return nil, err
		}
	}
	if err := c.ApplyEnv(getenv); err != nil {
		return nil, err
	}

	v.apply(c, set)
	var errs []error
	for k, spec := range v.upstreams {
		u, err := ParseUpstream(spec)
		if err != nil {
			errs = append(errs, fmt.Errorf("-upstream: %w", err))
			continue
		}
		u.origin = fmt.Sprintf("-upstream[%d]", k)
		c.Upstreams = append(c.Upstreams, u)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// apply sets in c the settings given as flags (set names them), over
// those of the environment and the config file.
func (v *flagValues) apply(c *Config, set map[string]bool) {
	var (
		server, caFile *string
		insecure       *bool
	)
	if set["server"] {
		server = &v.server
	}
	if set["insecure"] {
		insecure = &v.insecure
	}
	if set["ca-file"] {
		caFile = &v.caFile
	}
	c.setServer(server, insecure, caFile)
	var certFile, keyFile *string
	if set["cert-file"] {
		certFile = &v.certFile
	}
	if set["key-file"] {
		keyFile = &v.keyFile
	}
	c.setClientCert(certFile, keyFile)
	if set["id"] {
		c.ID = v.id
	}
	if set["log-level"] {
		c.LogLevel = v.logLevel
	}
	if set["max-connections"] {
		c.MaxConnections = v.maxConns
	}
	if set["tunnel-budget"] {
		c.TunnelBudget = v.tunnelBudget
	}
	if set["shutdown-grace"] {
		c.ShutdownGrace = v.shutdownGrace
	}
	if set["disable-data-lane"] {
		c.DisableDataLane = v.disableLane
	}
	if set["disable-direct-sockets"] {
		c.DisableDirectSockets = v.disableDirect
	}
	if set["admin-listen"] {
		c.AdminListen = v.adminListen
	}
	if set["server-each-address"] {
		c.ServerEachAddress = v.serverEach
	}
	if set["server-refresh"] {
		c.ServerRefresh = v.serverRefresh
	}
	if set["keepalive-time"] {
		c.KeepaliveTime = v.keepaliveTime
	}
	if set["keepalive-timeout"] {
		c.KeepaliveTimeout = v.keepaliveTimeout
	}
	if set["tunnel-stall-timeout"] {
		c.TunnelStallTimeout = v.stallTimeout
	}
	if set["token"] || set["token-file"] {
		c.setToken(v.token, v.tokenFile)
	}
}

type flagValues struct {
	config, server, token, tokenFile, id, caFile, logLevel string
	adminListen, certFile, keyFile                         string
	insecure, version, disableLane, disableDirect          bool
	serverEach                                             bool
	maxConns                                               int
	tunnelBudget                                           int64
	shutdownGrace, serverRefresh                           time.Duration
	keepaliveTime, keepaliveTimeout, stallTimeout          time.Duration
	upstreams                                              stringList
}

func newFlagSet() (*flag.FlagSet, *flagValues) {
	v := new(flagValues)
	fs := flag.NewFlagSet("sluice-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&v.config, "config", "", "YAML configuration `file` ($"+EnvConfig+")")
	fs.StringVar(&v.server, "server", "", "sluice server, grpc://host:port or grpcs://host:port ($"+EnvServer+")")
	fs.StringVar(&v.token, "token", "", "authentication token ($"+EnvToken+")")
	fs.StringVar(&v.tokenFile, "token-file", "", "read the token from `file` ($"+EnvTokenFile+")")
	fs.StringVar(&v.id, "id", "", "agent id; default agent-<12 random hex digits> ($"+EnvID+")")
	fs.BoolVar(&v.insecure, "insecure", false, "grpcs: do not verify the server certificate ($"+EnvInsecure+")")
	fs.StringVar(&v.caFile, "ca-file", "", "grpcs: PEM CA bundle `file` to trust instead of the system roots ($"+EnvCAFile+")")
	fs.StringVar(&v.certFile, "cert-file", "", "grpcs: PEM client certificate `file` to present to the node, with -key-file; read again before each connection attempt; makes the token optional ($"+EnvCertFile+")")
	fs.StringVar(&v.keyFile, "key-file", "", "grpcs: PEM private key `file` of -cert-file ($"+EnvKeyFile+")")
	fs.StringVar(&v.logLevel, "log-level", "", "debug, info, warn or error; default info ($"+EnvLogLevel+")")
	fs.IntVar(&v.maxConns, "max-connections", 0, "maximum concurrent connections; 0 = default ($"+EnvMaxConnections+")")
	fs.Int64Var(&v.tunnelBudget, "tunnel-budget", 0, "bytes receive windows above 64 KiB may hold; 0 = derived from memory ($"+EnvTunnelBudget+")")
	fs.DurationVar(&v.shutdownGrace, "shutdown-grace", 0, "on SIGINT/SIGTERM, how long open connections may finish; a second signal cuts them; 0 = "+DefaultShutdownGrace.String()+" ($"+EnvShutdownGrace+")")
	fs.BoolVar(&v.disableLane, "disable-data-lane", false, "keep sessions on the gRPC stream: no second connection for the data lane ($"+EnvDisableLane+")")
	fs.BoolVar(&v.disableDirect, "disable-direct-sockets", false, "keep every connection on the data lane: no socket of its own for a bulk connection ($"+EnvDisableDirect+")")
	fs.StringVar(&v.adminListen, "admin-listen", "", "serve /metrics, /healthz, /readyz and /status on `host:port`, e.g. 127.0.0.1:9001; no authentication: keep it on loopback; default off ($"+EnvAdminListen+")")
	fs.BoolVar(&v.serverEach, "server-each-address", false, "resolve the host of -server and keep a session with every address (one per cluster node), resolving it again every -server-refresh ($"+EnvServerEach+")")
	fs.DurationVar(&v.serverRefresh, "server-refresh", 0, "with -server-each-address, how often to resolve the host again; at least 1s; 0 = "+DefaultServerRefresh.String()+" ($"+EnvServerRefresh+")")
	fs.DurationVar(&v.keepaliveTime, "keepalive-time", 0, "interval of the gRPC keepalive pings to each node; at least "+MinKeepaliveTime.String()+" (the node's ping policy); 0 = "+DefaultKeepaliveTime.String()+" ($"+EnvKeepaliveTime+")")
	fs.DurationVar(&v.keepaliveTimeout, "keepalive-timeout", 0, "how long a keepalive ping's answer may take before the connection is torn down and the agent reconnects; 0 = "+DefaultKeepaliveTimeout.String()+" ($"+EnvKeepaliveTO+")")
	fs.DurationVar(&v.stallTimeout, "tunnel-stall-timeout", 0, "how long frames may wait for a node that takes none before the agent reconnects; 0 = "+DefaultTunnelStallTimeout.String()+", negative = off ($"+EnvStallTimeout+")")
	fs.Var(&v.upstreams, "upstream", "upstream `spec`, repeatable ($"+EnvUpstreams+", separated by ';')")
	// Listed here so that -h shows it among the flags; ParseFlags answers
	// it with ErrVersion.
	fs.BoolVar(&v.version, "version", false, "print the version and exit")
	return fs, v
}

// helpError is returned by ParseFlags for -h: its text is the usage.
type helpError struct{}

func (helpError) Error() string {
	var b bytes.Buffer
	Usage(&b)
	return strings.TrimRight(b.String(), "\n")
}

func (helpError) Unwrap() error { return flag.ErrHelp }

// Usage writes the command line help of sluice-agent: flags, environment
// variables and the upstream spec syntax.
func Usage(w io.Writer) {
	fs, _ := newFlagSet()
	fs.SetOutput(w)
	fmt.Fprintf(w, "Usage: sluice-agent [flags]\n\nFlags:\n")
	fs.PrintDefaults()
	fmt.Fprintf(w, `
Precedence: a setting given as a flag overrides the environment, which
overrides the config file. Upstreams are combined instead: those of the
config file, then those of %s, then the -upstream flags.

Environment:
  %s  %s  %s  %s
  %s  %s  %s  %s  %s
  %s  %s  %s  %s
  %s  %s  %s  %s
  %s  %s  %s  %s
  %s

Upstream spec (-upstream, %s):
  comma-separated key=value pairs; boolean keys may appear bare:
    host=app.example.com,target=http://127.0.0.1:3000
    host=app.example.com,target=127.0.0.1:3000   (no scheme: http://)
    host_pattern=.*\.example\.com,target=https://10.0.0.5:8443,insecure_skip_verify
    host=db.example.com,target=tcp://127.0.0.1:5432,tls_passthrough
    listen_port=16379,target=tcp://127.0.0.1:6379,proxy_protocol=v2
  keys: name host host_pattern target rewrite_host insecure_skip_verify
        tls_passthrough listen_port proxy_protocol force_http1
        allowed_cidrs (repeatable) verbatim_idle_timeout (e.g. 30s)
        udp_idle_timeout (udp:// targets, default 60s)
  short form: HOST=TARGET[,key=value...], e.g. app.example.com=127.0.0.1:3000
  catch-all:  *=TARGET
  named TCP service: name=redis,target=tcp://127.0.0.1:6379, reached only
    by the node's layer4 route "sluice redis", never by HTTP
  UDP: name=dns,target=udp://127.0.0.1:53 (a layer4 UDP server's "sluice dns")
    or listen_port=5353,target=udp://127.0.0.1:53 (a UDP port of the node)
  https targets are always spoken to over HTTP/1.1 (force_http1 is implied),
  so an HTTP/2-only TLS upstream (e.g. gRPC over TLS) is not supported
  through an https:// target.
`, EnvUpstreams, EnvConfig, EnvServer, EnvToken, EnvTokenFile,
		EnvID, EnvInsecure, EnvCAFile, EnvCertFile, EnvKeyFile,
		EnvLogLevel, EnvMaxConnections, EnvTunnelBudget, EnvShutdownGrace,
		EnvUpstreams, EnvDisableLane, EnvDisableDirect, EnvAdminListen,
		EnvServerEach, EnvServerRefresh, EnvKeepaliveTime, EnvKeepaliveTO,
		EnvStallTimeout, EnvUpstreams)
}

type stringList []string

func (l *stringList) String() string { return strings.Join(*l, " ") }

func (l *stringList) Set(s string) error {
	*l = append(*l, s)
	return nil
}

var specKeys = map[string]bool{
	"name": false, "host": false, "host_pattern": false, "target": false,
	"rewrite_host": false, "listen_port": false, "proxy_protocol": false,
	"allowed_cidrs": false, "verbatim_idle_timeout": false, "udp_idle_timeout": false,
	// boolean keys
	"insecure_skip_verify": true, "tls_passthrough": true, "force_http1": true,
}

// isWord reports whether s looks like a key name rather than a piece of a
// regexp: a letter, then letters, digits, '_' or '-'.
func isWord(s string) bool {
	for i, r := range s {
		letter := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z'
		if !letter && (i == 0 || !(r >= '0' && r <= '9' || r == '_' || r == '-')) {
			return false
		}
	}
	return s != ""
}

// looksLikeShortForm reports whether the first pair of a spec, whose key is
// not a key name, is the short form HOST=TARGET: its target has a scheme, or
// its host looks like one (a dot, a colon or "*"). A mistyped key
// ("hst=app.example.com") is then reported as such, while
// "app.example.com=127.0.0.1:3000" is a host and a target without a scheme
// (http://).
func looksLikeShortForm(key, val string) bool {
	return strings.Contains(val, "://") || strings.ContainsAny(key, ".:*")
}

// ParseUpstream parses an upstream spec, the syntax of -upstream and
// SLUICE_UPSTREAMS: comma-separated key=value pairs named like the YAML
// fields (a '-' in a key is read as '_'), boolean keys possibly bare, e.g.
//
//	host=app.example.com,target=http://127.0.0.1:3000,rewrite_host=app.local
//	listen_port=16379,target=tcp://127.0.0.1:6379,proxy_protocol=v2
//
// When the first key is not a key name and the pair looks like one
// (looksLikeShortForm), the first pair is HOST=TARGET:
// "app.example.com=http://127.0.0.1:3000", and "*=TARGET" is the catch-all.
// allowed_cidrs may repeat and may list several prefixes separated by
// spaces. A comma inside a host_pattern value (as in "a{1,3}") is kept when
// the text after it has no '=' and is not a bare word (letters, digits,
// '_' and '-', starting with a letter): any other key=value pair or bare
// word must be a known key, so that a mistyped key ("rewrite_hots=x",
// "insecure_skip_verfy") is reported instead of joining the pattern. The
// result is not validated.
func ParseUpstream(spec string) (Upstream, error) {
	if strings.TrimSpace(spec) == "" {
		return Upstream{}, fmt.Errorf("upstream spec %q: empty", spec)
	}
	p := specParser{seen: map[string]bool{}}
	for i, raw := range strings.Split(spec, ",") {
		if err := p.pair(i, raw); err != nil {
			return Upstream{}, fmt.Errorf("upstream spec %q: %w", spec, err)
		}
	}
	u := p.u
	u.HostPattern = strings.TrimSpace(u.HostPattern)
	if u.Target == "" {
		return Upstream{}, fmt.Errorf("upstream spec %q: target missing", spec)
	}
	return u, nil
}

// specParser is ParseUpstream's state between the pairs of a spec.
type specParser struct {
	u    Upstream
	seen map[string]bool // keys given
	prev string          // the key of the previous pair
}

// specPair is one comma-separated piece of a spec.
type specPair struct {
	index  int
	raw    string // as written, for a comma inside a host_pattern
	part   string // raw, trimmed
	rawKey string // the key as written
	key    string // normalised: lower case, '-' read as '_'
	val    string
	hasVal bool
}

// pair applies the i-th comma-separated piece raw of a spec.
func (p *specParser) pair(i int, raw string) error {
	part := strings.TrimSpace(raw)
	if part == "" {
		return nil
	}
	k, val, hasVal := strings.Cut(part, "=")
	sp := specPair{index: i, raw: raw, part: part, rawKey: k, val: strings.TrimSpace(val), hasVal: hasVal,
		key: strings.ReplaceAll(strings.ToLower(strings.TrimSpace(k)), "-", "_")}
	isBool, known := specKeys[sp.key]
	if !known {
		return p.unknownKey(sp)
	}
	if p.seen[sp.key] && sp.key != "allowed_cidrs" {
		return fmt.Errorf("%s given twice", sp.key)
	}
	p.seen[sp.key] = true
	p.prev = sp.key
	if isBool {
		return p.setBool(sp)
	}
	if !sp.hasVal {
		return fmt.Errorf("%s needs a value (%s=...)", sp.key, sp.key)
	}
	return p.set(sp.key, sp.val)
}

// unknownKey handles a piece whose key is no key name: the short form
// HOST=TARGET as the first piece, a comma inside a host_pattern, or an
// error naming the key.
func (p *specParser) unknownKey(sp specPair) error {
	switch {
	case sp.index == 0 && sp.hasVal && looksLikeShortForm(sp.rawKey, sp.val):
		host := strings.TrimSpace(sp.rawKey)
		if host == "" {
			return errors.New("empty host before '='")
		}
		p.u.Host = host // "*", the catch-all, as host=* (validate reads it)
		p.u.Target = sp.val
		p.seen["host"], p.seen["target"] = true, true
		p.prev = "target"
		return nil
	case sp.index == 0 && sp.hasVal:
		return fmt.Errorf("unknown key %q (in the short form HOST=TARGET, the target has a scheme, as in http://, https:// or tcp://, or the host a dot or a colon, or is *)", strings.TrimSpace(sp.rawKey))
	case sp.hasVal || isWord(sp.key):
		return fmt.Errorf("unknown key %q", strings.TrimSpace(sp.rawKey))
	case p.prev == "host_pattern":
		p.u.HostPattern += "," + sp.raw
		return nil
	default:
		return fmt.Errorf("%q is not key=value", sp.part)
	}
}

// setBool applies a boolean key, bare (true) or key=bool.
func (p *specParser) setBool(sp specPair) error {
	b := true
	if sp.hasVal {
		var err error
		if b, err = strconv.ParseBool(sp.val); err != nil {
			return fmt.Errorf("%s: invalid boolean %q", sp.key, sp.val)
		}
	}
	switch sp.key {
	case "insecure_skip_verify":
		p.u.InsecureSkipVerify = b
	case "tls_passthrough":
		p.u.TLSPassthrough = b
	case "force_http1":
		p.u.ForceHTTP1 = b
	}
	return nil
}

// set applies a key=value pair of a key that takes a value.
func (p *specParser) set(key, val string) error {
	u := &p.u
	switch key {
	case "name":
		u.Name = val
	case "host":
		u.Host = val
	case "host_pattern":
		u.HostPattern = val
	case "target":
		u.Target = val
	case "rewrite_host":
		u.RewriteHost = val
	case "listen_port":
		n, err := strconv.Atoi(val)
		if err != nil {
			return fmt.Errorf("listen_port: invalid port %q", val)
		}
		u.ListenPort = n
	case "proxy_protocol":
		u.ProxyProtocol = val
	case "allowed_cidrs":
		u.AllowedCIDRs = append(u.AllowedCIDRs, strings.Fields(val)...)
	case "verbatim_idle_timeout":
		d, err := time.ParseDuration(val)
		if err != nil {
			return fmt.Errorf("verbatim_idle_timeout: invalid duration %q", val)
		}
		u.VerbatimIdleTimeout = d
	case "udp_idle_timeout":
		d, err := time.ParseDuration(val)
		if err != nil {
			return fmt.Errorf("udp_idle_timeout: invalid duration %q", val)
		}
		u.UDPIdleTimeout = d
	}
	return nil
}
