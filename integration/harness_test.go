package integration

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
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
	"go.uber.org/zap/zaptest"

	"github.com/sluice-tunnel/sluice/agent"
	_ "github.com/sluice-tunnel/sluice/caddymodule"
	_ "github.com/sluice-tunnel/sluice/l4module"
)

const testToken = "integration-test-token"

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// caddyServer is an in-process Caddy running an adapted Caddyfile.
type caddyServer struct {
	t           testing.TB
	controlPort int
	httpPort    int
	httpsPort   int
	storage     string
	global      string // extra global options (startCaddyGlobal, loadGlobal)
}

// caddyMu serialises tests that run Caddy: its config is process-global.
var caddyMu sync.Mutex

// startCaddy loads a Caddyfile whose sites are given by body. The global
// options bind everything to loopback: the sluice control plane, the HTTP
// and HTTPS ports, no admin endpoint.
func startCaddy(t testing.TB, body string) *caddyServer {
	t.Helper()
	return startCaddyGlobal(t, "", body)
}

// startCaddyGlobal is startCaddy with extra global options (layer4 blocks,
// servers options, more sluice settings: several sluice blocks merge).
// {HTTP} and {HTTPS} in global and body stand for the site ports.
func startCaddyGlobal(t testing.TB, global, body string) *caddyServer {
	t.Helper()
	caddyMu.Lock()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	c := &caddyServer{t: t, controlPort: freePort(t), httpPort: freePort(t), httpsPort: freePort(t), storage: t.TempDir(), global: global}
	c.load(body)
	t.Cleanup(func() {
		caddy.Stop()
		caddyMu.Unlock()
	})
	return c
}

func (c *caddyServer) caddyfile(body string) string {
	cf := fmt.Sprintf(`{
	admin off
	persist_config off
	skip_install_trust
	storage file_system %s
	http_port %d
	https_port %d
	default_bind 127.0.0.1
	log default {
		level WARN
	}
	sluice {
		listen 127.0.0.1:%d
		token %s
	}
%s
}

%s
`, c.storage, c.httpPort, c.httpsPort, c.controlPort, testToken, c.global, body)
	return strings.NewReplacer("{HTTP}", fmt.Sprint(c.httpPort), "{HTTPS}", fmt.Sprint(c.httpsPort)).Replace(cf)
}

// load adapts and (re)loads a Caddyfile body: a second call is a reload.
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

// loadGlobal reloads with other extra global options.
func (c *caddyServer) loadGlobal(global, body string) {
	c.t.Helper()
	c.global = global
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
	a := launchAgent(t, serverURL, id, testToken, upstreams...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.WaitConnected(ctx); err != nil {
		t.Fatalf("agent %s never connected: %v", id, err)
	}
	return a
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
	cfg := &agent.Config{Server: serverURL, Token: token, ID: id, Upstreams: upstreams}
	if adjust != nil {
		adjust(cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("agent config: %v", err)
	}
	logger := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named(id)
	a, err := agent.New(cfg, logger, agent.WithBackoff(50*time.Millisecond, 500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &runningAgent{Agent: a, cancel: cancel, done: make(chan error, 1)}
	go func() { ra.done <- a.Run(ctx) }()
	t.Cleanup(ra.stop)
	return ra
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

// eventually polls cond until it holds or within passes.
func eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

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
