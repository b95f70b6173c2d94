package integration

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	_ "github.com/caddyserver/caddy/v2/modules/caddypki"
	_ "github.com/caddyserver/caddy/v2/modules/caddytls"
	_ "github.com/caddyserver/caddy/v2/modules/filestorage"
	_ "github.com/mholt/caddy-l4/layer4"
	_ "github.com/mholt/caddy-l4/modules/l4proxyprotocol"
	_ "github.com/mholt/caddy-l4/modules/l4tls"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/sluice-tunnel/sluice/agent"
	_ "github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/testwait"
	_ "github.com/sluice-tunnel/sluice/l4module"
)

const testToken = "integration-test-token-0123456789abcdef"

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if portsHandedOut.take(port) {
			return port
		}
	}
	t.Fatal("no loopback port that was not handed out already")
	return 0
}

// portsHandedOut are the ports freePort returned in this test binary. The
// kernel may give a closed port out again, and Caddy binds with
// SO_REUSEPORT: two servers of one test on one port would silently share
// its connections (a layer4 server's going to an agent port, say).
var portsHandedOut = &portSet{taken: map[int]bool{}}

type portSet struct {
	mu    sync.Mutex
	taken map[int]bool
}

// take marks port handed out; false if it was already.
func (s *portSet) take(port int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.taken[port] {
		return false
	}
	s.taken[port] = true
	return true
}

// caddyOptions are the optional parts of the Caddyfile a test runs.
type caddyOptions struct {
	// Sluice is extra lines inside the global sluice block, beside the
	// loopback listen address and token (e.g. "max_connections 4").
	Sluice string
	// Listen is the control listen address, with {CONTROL} for the
	// control port. Default 127.0.0.1:{CONTROL}.
	Listen string
	// Global is extra global options (layer4 blocks, servers options, more
	// sluice settings: several sluice blocks merge).
	Global string
	// NoRedirects turns off the automatic HTTP->HTTPS redirects.
	NoRedirects bool
	// CaptureLog makes Caddy's default logger write JSON at INFO to a file
	// the test reads back (streamLines); otherwise it logs WARN and up to
	// stderr.
	CaptureLog bool
}

// caddyServer is an in-process Caddy running an adapted Caddyfile.
type caddyServer struct {
	t           testing.TB
	controlPort int
	httpPort    int
	httpsPort   int
	storage     string
	opts        caddyOptions
	logPath     string // the captured log (opts.CaptureLog)
}

// caddyMu serialises tests that run Caddy: its config is process-global.
var caddyMu sync.Mutex

// startCaddy loads a Caddyfile whose sites are given by body. The global
// options bind everything to loopback: the sluice control plane, the HTTP
// and HTTPS ports, no admin endpoint.
func startCaddy(t testing.TB, body string) *caddyServer {
	t.Helper()
	return startCaddyWith(t, caddyOptions{}, body)
}

// startCaddyWith is startCaddy with the optional parts of opts. It holds
// caddyMu until cleanup, which stops Caddy. {HTTP} and {HTTPS} in the
// options and body stand for the site ports.
func startCaddyWith(t testing.TB, opts caddyOptions, body string) *caddyServer {
	t.Helper()
	caddyMu.Lock()
	t.Cleanup(caddyMu.Unlock)
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	c := &caddyServer{t: t, controlPort: freePort(t), httpPort: freePort(t), httpsPort: freePort(t), storage: t.TempDir(), opts: opts}
	if opts.CaptureLog {
		c.logPath = filepath.Join(t.TempDir(), "caddy.log")
	}
	// Registered after the temporary directories, so it runs before they
	// are removed.
	t.Cleanup(func() { caddy.Stop() })
	c.load(body)
	return c
}

func (c *caddyServer) caddyfile(body string) string {
	var redirects string
	if c.opts.NoRedirects {
		redirects = "\tauto_https disable_redirects\n"
	}
	logOpts := "\t\tlevel WARN\n"
	if c.logPath != "" {
		logOpts = fmt.Sprintf("\t\toutput sluice_test_file %s\n\t\tlevel INFO\n", c.logPath)
	}
	cf := fmt.Sprintf(`{
	admin off
	persist_config off
	skip_install_trust
	storage file_system %s
	http_port %d
	https_port %d
	default_bind 127.0.0.1
%s	log default {
%s	}
	sluice {
		listen %s
		token %s
%s
	}
%s
}

%s
`, c.storage, c.httpPort, c.httpsPort, redirects, logOpts, cmp.Or(c.opts.Listen, "127.0.0.1:{CONTROL}"), testToken, c.opts.Sluice, c.opts.Global, body)
	return strings.NewReplacer("{HTTP}", strconv.Itoa(c.httpPort), "{HTTPS}", strconv.Itoa(c.httpsPort),
		"{CONTROL}", strconv.Itoa(c.controlPort)).Replace(cf)
}

// load adapts and loads the Caddyfile: the first call starts Caddy, a later
// one is a reload (or a fresh start on the same ports after caddy.Stop).
func (c *caddyServer) load(body string) {
	c.t.Helper()
	cfgJSON, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(c.caddyfile(body)), nil)
	if err != nil {
		c.t.Fatalf("adapt: %v", err)
	}
	if err := caddy.Load(cfgJSON, true); err != nil {
		c.t.Fatalf("caddy load: %v", err)
	}
}

// tryLoadGlobal is loadGlobal for a config expected to fail: it returns
// Caddy's error, and the running config stays as it was.
func (c *caddyServer) tryLoadGlobal(global, body string) error {
	c.t.Helper()
	saved := c.opts.Global
	c.opts.Global = global
	defer func() { c.opts.Global = saved }()
	cfgJSON, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(c.caddyfile(body)), nil)
	if err != nil {
		c.t.Fatalf("adapt: %v", err)
	}
	return caddy.Load(cfgJSON, true)
}

// loadGlobal reloads with other extra global options.
func (c *caddyServer) loadGlobal(global, body string) {
	c.t.Helper()
	c.opts.Global = global
	c.load(body)
}

// url is the plain-HTTP URL of path on the site port.
func (c *caddyServer) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", c.httpPort, path)
}

func (c *caddyServer) serverURL() string {
	return fmt.Sprintf("grpc://127.0.0.1:%d", c.controlPort)
}

// runningAgent is an in-process sluice-agent.
type runningAgent struct {
	*agent.Agent
	cancel context.CancelFunc
	done   chan error
}

// startAgent runs an agent for upstreams against c and waits until the node
// acknowledged it.
func startAgent(t testing.TB, serverURL, id string, upstreams ...agent.Upstream) *runningAgent {
	t.Helper()
	return startAgentWith(t, serverURL, id, nil, upstreams...)
}

// startAgentWith is startAgent with a hook to adjust the configuration.
func startAgentWith(t testing.TB, serverURL, id string, adjust func(*agent.Config), upstreams ...agent.Upstream) *runningAgent {
	t.Helper()
	a := launchAgentWith(t, serverURL, id, testToken, adjust, upstreams...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.WaitConnected(ctx); err != nil {
		t.Fatalf("agent %s never connected: %v", id, err)
	}
	return a
}

func launchAgent(t testing.TB, serverURL, id, token string, upstreams ...agent.Upstream) *runningAgent {
	t.Helper()
	return launchAgentWith(t, serverURL, id, token, nil, upstreams...)
}

func launchAgentWith(t testing.TB, serverURL, id, token string, adjust func(*agent.Config), upstreams ...agent.Upstream) *runningAgent {
	t.Helper()
	a, _ := launchAgentLogged(t, serverURL, id, token, adjust, false, upstreams...)
	return a
}

// launchAgentObserved is launchAgent with the agent's log lines (Info and
// up) also recorded for assertions.
func launchAgentObserved(t testing.TB, serverURL, id string, upstreams ...agent.Upstream) (*runningAgent, *observer.ObservedLogs) {
	t.Helper()
	return launchAgentLogged(t, serverURL, id, testToken, nil, true, upstreams...)
}

// launchAgentLogged runs an agent that logs Warn and up to the test, and,
// if observe, records Info and up in the returned logs (else nil).
func launchAgentLogged(t testing.TB, serverURL, id, token string, adjust func(*agent.Config), observe bool, upstreams ...agent.Upstream) (*runningAgent, *observer.ObservedLogs) {
	t.Helper()
	cfg := &agent.Config{Server: serverURL, Token: token, ID: id, Upstreams: upstreams}
	if adjust != nil {
		adjust(cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("agent config: %v", err)
	}
	logger := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
	var logs *observer.ObservedLogs
	if observe {
		var obsCore zapcore.Core
		obsCore, logs = observer.New(zap.InfoLevel)
		logger = zap.New(zapcore.NewTee(logger.Core(), obsCore))
	}
	logger = logger.Named(id)
	a, err := agent.New(cfg, logger, agent.WithBackoff(50*time.Millisecond, 500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &runningAgent{Agent: a, cancel: cancel, done: make(chan error, 1)}
	go func() { ra.done <- a.Run(ctx) }()
	t.Cleanup(ra.stop)
	return ra, logs
}

// waitConnected waits (bounded) for a launched agent's first session.
func waitConnected(t testing.TB, a *runningAgent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.WaitConnected(ctx); err != nil {
		t.Fatalf("agent never connected: %v", err)
	}
}

// stop ends the agent and waits for it (bounded).
func (a *runningAgent) stop() {
	a.cancel()
	select {
	case <-a.done:
		a.done <- nil // keep stop idempotent
	case <-time.After(10 * time.Second):
	}
}

// hostClient sends requests to Caddy's plain HTTP port with a given Host.
func hostClient() *http.Client {
	return &http.Client{
		Timeout:   60 * time.Second,
		Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 16},
	}
}

func get(t testing.TB, c *caddyServer, host, path string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url(path), nil)
	req.Host = host
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatalf("GET %s%s: %v", host, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// getAfterReload is get for the first request after a reload. caddy.Load
// returns once the old servers' Shutdown has been started, not finished:
// for a moment the old listener, which shares the port (SO_REUSEPORT), may
// still take a connection and then reset or close it unanswered as it
// shuts down. That is Caddy's reload, not the tunnel, so a reset, a refused
// dial or an EOF before any response is retried (bounded).
func getAfterReload(t testing.TB, c *caddyServer, host, path string) (int, string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		req, _ := http.NewRequest("GET", c.url(path), nil)
		req.Host = host
		resp, err := hostClient().Do(req)
		if err == nil {
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		retryable := errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, io.EOF)
		if time.Now().After(deadline) || !retryable {
			t.Fatalf("GET %s%s after reload: %v", host, path, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// reloadWithNewSite reloads with body plus a new site, extra.test, and
// checks the new config answers: the changed config of the "reload keeps
// ..." tests.
func reloadWithNewSite(t testing.TB, c *caddyServer, body string) {
	t.Helper()
	c.load(body + "\n\nhttp://extra.test:{HTTP} {\n\trespond \"new site\"\n}\n")
	// A connection the old server accepted just before it stopped can
	// still answer with the old config: poll, bounded.
	eventually(t, 5*time.Second, "the new config answering", func() bool {
		code, got := getAfterReload(t, c, "extra.test", "/")
		return code == 200 && got == "new site"
	})
}

// eventually polls cond until it holds or within passes.
var eventually = testwait.Until

// needCommand skips the test when a real client is not installed, unless
// running in CI, where .ci/run installs it and its absence is a failure.
func needCommand(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is required in CI (.ci/run installs it)", name)
		}
		t.Skipf("%s not installed", name)
	}
	return p
}

// insecureTLS trusts Caddy's internal CA for tests.
func insecureTLS(serverName string) *tls.Config {
	return &tls.Config{InsecureSkipVerify: true, ServerName: serverName}
}

// caddyStop stops the running config as a process exit would.
func caddyStop(t testing.TB) {
	t.Helper()
	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
}
