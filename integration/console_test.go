package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/caddyauth" // basic_auth
	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"golang.org/x/crypto/bcrypt"

	"github.com/sluice-tunnel/sluice/agent"
)

const (
	chromiumPath = "/usr/bin/chromium"
	consoleUser  = "admin"
	consolePass  = "console-test-password"
)

// consoleSite mounts the console under /console/ behind basic_auth; %s is
// the bcrypt hash of consolePass.
const consoleSite = `http://console.test:{HTTP} {
	handle_path /console/* {
		basic_auth {
			admin %s
		}
		sluice_console
	}
}
http://:{HTTP} {
	sluice
}
`

// startConsoleCaddy runs Caddy with the console site and a port range of
// one port, which it returns, for a listen-port route.
func startConsoleCaddy(t *testing.T) (*caddyServer, int) {
	t.Helper()
	hash, err := bcrypt.GenerateFromPassword([]byte(consolePass), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	opts := caddyOptions{Sluice: fmt.Sprintf("\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1", port, port)}
	return startCaddyWith(t, opts, fmt.Sprintf(consoleSite, hash)), port
}

// consoleGet GETs path of the console site with the credentials given
// (none when user is empty).
func consoleGet(t *testing.T, c *caddyServer, path, user, pass string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest("GET", c.url(path), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = "console.test"
	if user != "" {
		req.SetBasicAuth(user, pass)
	}
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body
}

// TestConsoleRefusesWrongPassword: basic_auth guards page and data alike.
func TestConsoleRefusesWrongPassword(t *testing.T) {
	c, _ := startConsoleCaddy(t)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: startUpstream(t, "x")})
	for _, path := range []string{"/console/", "/console/api/state", "/console/api/lookup?host=app.test", "/console/app.js"} {
		for _, cred := range [][2]string{{consoleUser, "wrong"}, {"", ""}, {"root", consolePass}} {
			code, body := consoleGet(t, c, path, cred[0], cred[1])
			if code != http.StatusUnauthorized || strings.Contains(string(body), "agent-a") || strings.Contains(string(body), "sluice") {
				t.Errorf("%s as %q/%q: %d %q", path, cred[0], cred[1], code, body)
			}
		}
	}
	if code, body := consoleGet(t, c, "/console/api/state", consoleUser, consolePass); code != 200 || !strings.Contains(string(body), "agent-a") {
		t.Fatalf("right password: %d %s", code, body)
	}
	if code, body := consoleGet(t, c, "/console/api/state", consoleUser, consolePass); strings.Contains(string(body), testToken) {
		t.Fatalf("state shows the token: %d %s", code, body)
	}
}

// consoleVarying are the keys whose values change from run to run: times,
// addresses and ports, builds, counters.
var consoleVarying = map[string]bool{
	"now": true, "serving_since": true, "connected_since": true, "listen": true, "address": true,
	"remote": true, "id": true, "build": true, "caddy": true, "tcp_port_range": true,
}

// normaliseConsole replaces the values that vary (consoleVarying, every
// number, a listen-port route's key) with their type, keeping the keys and
// the values that identify agents and routes.
func normaliseConsole(v any, key string) any {
	switch x := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, e := range x {
			out[k] = normaliseConsole(e, k)
		}
		if _, ok := x["key"]; ok && x["kind"] == "listen port" {
			out["key"] = "<port>"
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normaliseConsole(e, key)
		}
		return out
	case float64:
		return "<number>"
	case string:
		if consoleVarying[key] {
			return "<string>"
		}
	}
	return v
}

// TestConsoleStateMatchesFixture: the JSON endpoint's shape, with one
// agent of three routes, is testdata/console_state.json
// (SLUICE_UPDATE_FIXTURES=1 rewrites it).
func TestConsoleStateMatchesFixture(t *testing.T) {
	c, port := startConsoleCaddy(t)
	startAgent(t, c.serverURL(), "agent-a", consoleUpstreams(t, port)...)
	code, body := consoleGet(t, c, "/console/api/state", consoleUser, consolePass)
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	var got any
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	got = normaliseConsole(got, "")
	path := filepath.Join("testdata", "console_state.json")
	if os.Getenv("SLUICE_UPDATE_FIXTURES") != "" {
		var buf strings.Builder
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		enc.SetIndent("", "  ")
		if err := enc.Encode(got); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(buf.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var want any
	if err := json.Unmarshal(raw, &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		b, _ := json.MarshalIndent(got, "", "  ")
		t.Fatalf("state differs from %s; got:\n%s", path, b)
	}
}

// consoleUpstreams are an exact host, a host pattern and a listen-port
// route on port.
func consoleUpstreams(t *testing.T, port int) []agent.Upstream {
	up := startUpstream(t, "x")
	return []agent.Upstream{
		{Host: "app.test", Target: up},
		{HostPattern: `[a-z0-9-]+\.apps\.test`, Target: up},
		{Name: "db", ListenPort: port, Target: tcpTarget(serveTCP(t, echoHandler))},
	}
}

// browser is a headless Chromium page with the console's credentials on
// every request, collecting what the page reports as errors.
type browser struct {
	ctx    context.Context
	mu     sync.Mutex
	errors []string
}

// startBrowser starts Chromium, or skips when it is missing outside CI.
func startBrowser(t *testing.T) *browser {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		skipOrFail(t, fmt.Sprintf("no chromium: %v", err))
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromiumPath),
		chromedp.Flag("headless", true), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("no-proxy-server", true),
		chromedp.Flag("host-resolver-rules", "MAP console.test 127.0.0.1"),
		chromedp.WindowSize(1280, 900))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	b := &browser{ctx: ctx}
	if err := chromedp.Listen(ctx, b.collect); err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	auth := network.Headers{"Authorization": "Basic " + basicAuth(consoleUser, consolePass)}
	if _, err := chromedp.Call(ctx, network.Enable, network.EnableParams{}); err != nil {
		t.Fatalf("network.enable: %v", err)
	}
	if _, err := chromedp.Call(ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: auth}); err != nil {
		t.Fatalf("setting the Authorization header: %v", err)
	}
	return b
}

// collect keeps console errors and warnings, uncaught exceptions and
// error log entries (failed loads, CSP violations). It runs on the
// browser's reading goroutine, so it only appends.
func (b *browser) collect(ev any) {
	var msg string
	switch e := ev.(type) {
	case *runtime.EventConsoleAPICalled:
		if e.Type == runtime.ConsoleAPICalledTypeError || e.Type == runtime.ConsoleAPICalledTypeWarning || e.Type == runtime.ConsoleAPICalledTypeAssert {
			msg = fmt.Sprintf("console.%s: %v", e.Type, consoleArgs(e.Args))
		}
	case *runtime.EventExceptionThrown:
		msg = fmt.Sprintf("exception: %s", (&chromedp.ExceptionError{ExceptionDetails: e.ExceptionDetails}).Error())
	case *log.EventEntryAdded:
		if e.Entry.Level == log.EntryLevelError {
			msg = fmt.Sprintf("log: %s %s", e.Entry.Text, e.Entry.URL)
		}
	}
	if msg != "" {
		b.mu.Lock()
		b.errors = append(b.errors, msg)
		b.mu.Unlock()
	}
}

func consoleArgs(args []*runtime.RemoteObject) []string {
	var out []string
	for _, a := range args {
		out = append(out, fmt.Sprintf("%s%s", a.Value, a.Description))
	}
	return out
}

func basicAuth(user, pass string) string {
	req, _ := http.NewRequest("GET", "http://x/", nil)
	req.SetBasicAuth(user, pass)
	return strings.TrimPrefix(req.Header.Get("Authorization"), "Basic ")
}

// do runs steps with a bound on the time they take.
func (b *browser) do(t *testing.T, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatalf("chromium: %v", err)
	}
}

// eval evaluates a JavaScript expression (awaiting a promise) and
// returns its value.
func eval[T any](t *testing.T, b *browser, expr string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatalf("chromium: evaluating %s: %v", expr, err)
	}
	return v
}

// text is the text of the element id.
func (b *browser) text(t *testing.T, id string) string {
	t.Helper()
	return eval[string](t, b, fmt.Sprintf(`document.getElementById(%q).textContent`, id))
}

// within waits up to d for cond on the text of id, and returns how long
// it took.
func (b *browser) within(t *testing.T, d time.Duration, what, id string, cond func(string) bool) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if cond(b.text(t, id)) {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v; #%s shows %q", what, d, id, b.text(t, id))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// find asks the page's route finder, as a user would, and returns its
// answer's text.
func (b *browser) find(t *testing.T, kind, value string) string {
	t.Helper()
	eval[bool](t, b, fmt.Sprintf(`(() => {
		document.getElementById("find-result").textContent = "";
		document.getElementById("find-kind").value = %q;
		document.getElementById("find-value").value = %q;
		return true; })()`, kind, value))
	b.do(t, chromedp.Click(chromedp.CSS("#find-form button")))
	var got string
	b.within(t, 3*time.Second, "lookup "+kind+"="+value, "find-result", func(s string) bool { got = s; return s != "" })
	return got
}

// screenshot saves a PNG of the page at width × height (mobile: as a
// phone), the whole page or its first screen, and returns its path.
func (b *browser) screenshot(t *testing.T, name string, width, height int64, mobile, whole bool) string {
	t.Helper()
	dir := os.Getenv("SLUICE_ARTIFACTS")
	if dir == "" {
		dir = os.TempDir()
	}
	opts := []chromedp.EmulateViewportOption{chromedp.EmulateScale(1)}
	if mobile {
		opts = append(opts, chromedp.EmulateMobile)
	}
	b.do(t, chromedp.EmulateViewport(width, height, opts...), chromedp.Sleep(300*time.Millisecond))
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	shot := chromedp.CaptureScreenshot()
	if whole {
		shot = chromedp.FullScreenshot(100) // quality 100: PNG
	}
	png, err := chromedp.Run(ctx, shot)
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", path)
	return path
}

func (b *browser) checkNoErrors(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.errors) > 0 {
		t.Fatalf("the page reported errors:\n%s", strings.Join(b.errors, "\n"))
	}
}

// TestConsoleInBrowser: the page behind basic_auth shows an agent and its
// routes within 3 s of its connecting and drops it within 3 s of its
// leaving, its route finder answers for a host, a pattern and a port,
// and it reports no error.
func TestConsoleInBrowser(t *testing.T) {
	b := startBrowser(t)
	c, port := startConsoleCaddy(t)
	b.do(t, chromedp.Navigate(fmt.Sprintf("http://console.test:%d/console/", c.httpPort)))
	b.within(t, 5*time.Second, "first render", "agent-count", func(s string) bool { return s == "(0)" })

	a := startAgent(t, c.serverURL(), "agent-a", consoleUpstreams(t, port)...)
	took := b.within(t, 3*time.Second, "agent shown", "agents", func(s string) bool { return strings.Contains(s, "agent-a") })
	b.within(t, time.Second, "routes shown", "routes", func(s string) bool {
		return strings.Contains(s, "app.test") && strings.Contains(s, `[a-z0-9-]+\.apps\.test`) && strings.Contains(s, fmt.Sprint(port))
	})
	t.Logf("agent shown %v after it connected", took.Round(time.Millisecond))

	for _, q := range [][3]string{{"host", "app.test", "exact"}, {"host", "x-1.apps.test", "pattern"}, {"port", fmt.Sprint(port), "claimed_port"}} {
		if got := b.find(t, q[0], q[1]); !strings.Contains(got, "agent-a") || !strings.Contains(got, q[2]) {
			t.Errorf("find %s=%s: %q, want agent-a by %s", q[0], q[1], got, q[2])
		}
	}
	if got := b.find(t, "host", "nothing.test"); !strings.Contains(got, "No agent") {
		t.Errorf("find host=nothing.test: %q", got)
	}
	b.screenshot(t, "sluice-console-desktop.png", 1280, 900, false, true)
	b.screenshot(t, "sluice-console-phone.png", 390, 844, true, true)
	b.do(t, chromedp.EmulateViewport(1280, 900))

	a.stop()
	took = b.within(t, 3*time.Second, "agent gone", "agents", func(s string) bool { return !strings.Contains(s, "agent-a") })
	t.Logf("agent gone %v after it left", took.Round(time.Millisecond))
	b.checkNoErrors(t)
}

// TestConsoleRendersThousandRoutes: a node with 1,000 routes renders in
// under 1 s, measured in the browser around one render and its layout.
func TestConsoleRendersThousandRoutes(t *testing.T) {
	b := startBrowser(t)
	c, _ := startConsoleCaddy(t)
	up := startUpstream(t, "x")
	ups := make([]agent.Upstream, 1000)
	for i := range ups {
		ups[i] = agent.Upstream{Host: fmt.Sprintf("host-%04d.many.test", i), Target: up}
	}
	startAgent(t, c.serverURL(), "agent-many", ups...)
	b.do(t, chromedp.Navigate(fmt.Sprintf("http://console.test:%d/console/", c.httpPort)))
	b.within(t, 5*time.Second, "1,000 routes shown", "route-count", func(s string) bool { return s == "(1000)" })
	ms := eval[float64](t, b, `(async () => {
		const s = await (await fetch("api/state", {cache: "no-store"})).json();
		const t0 = performance.now();
		window.sluiceConsole.render(s);
		void document.body.offsetHeight; // the layout too
		return performance.now() - t0;
	})()`)
	t.Logf("1,000 routes rendered in %.1f ms", ms)
	if ms >= 1000 {
		t.Fatalf("1,000 routes took %.0f ms to render, want under 1 s", ms)
	}
	if n := eval[int](t, b, `document.querySelectorAll("#route-tables tbody tr").length`); n != 1000 {
		t.Fatalf("%d host rows, want 1000", n)
	}
	b.screenshot(t, "sluice-console-1000-routes.png", 1280, 900, false, false) // the whole page is megabytes
	b.checkNoErrors(t)
}
