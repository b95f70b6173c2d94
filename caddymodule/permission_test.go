package caddymodule

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddytls"

	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestCertificatePermissionByKind: each kind of route grants an on-demand
// certificate for the hosts it serves over HTTP by name, or grants none.
// A kind added to route.Kinds without an example here fails.
func TestCertificatePermissionByKind(t *testing.T) {
	examples := map[route.Kind]struct {
		route  *tunnelpb.Route
		host   string // a host the route serves (HTTP or TLS), or its name
		grants bool
	}{
		route.Host:               {&tunnelpb.Route{Host: "h.test", Target: "http://x:1"}, "h.test", true},
		route.HostPattern:        {&tunnelpb.Route{HostPattern: `[a-z]+\.p\.test`, Target: "http://x:1"}, "a.p.test", true},
		route.CatchAll:           {&tunnelpb.Route{Target: "http://x:1"}, "any.test", false},
		route.TCPHost:            {&tunnelpb.Route{Host: "t.test", Target: "tcp://x:1"}, "t.test", true},
		route.TCPHostPattern:     {&tunnelpb.Route{HostPattern: `[a-z]+\.tp\.test`, Target: "tcp://x:1"}, "a.tp.test", true},
		route.PassthroughHost:    {&tunnelpb.Route{Host: "s.test", TlsPassthrough: true, Target: "tcp://x:1"}, "s.test", false},
		route.PassthroughPattern: {&tunnelpb.Route{HostPattern: `[a-z]+\.sp\.test`, TlsPassthrough: true, Target: "tcp://x:1"}, "a.sp.test", false},
		route.NamedTCP:           {&tunnelpb.Route{Name: "redis", Target: "tcp://x:1"}, "redis", false},
		route.ListenPort:         {&tunnelpb.Route{ListenPort: 2222, Target: "tcp://x:1"}, "localhost", false},
		route.NamedUDP:           {&tunnelpb.Route{Name: "dns", Target: "udp://x:53"}, "dns", false},
		route.UDPListenPort:      {&tunnelpb.Route{ListenPort: 5353, Target: "udp://x:53"}, "localhost", false},
	}
	for _, k := range route.Kinds() {
		ex, ok := examples[k]
		if !ok {
			t.Errorf("kind %v: no example here; decide whether its hosts may get an on-demand certificate", k)
			continue
		}
		r := newRegistry()
		if e := register(t, r, "a", ex.route).routes[0]; e.kind != k {
			t.Fatalf("kind %v: its example is of kind %v", k, e.kind)
		}
		if got := r.table.Load().servesCertificateFor(ex.host); got != ex.grants {
			t.Errorf("kind %v: servesCertificateFor(%q) = %v, want %v", k, ex.host, got, ex.grants)
		}
		if grantsCertificate(&routeEntry{kind: k}) != ex.grants {
			t.Errorf("kind %v: grantsCertificate disagrees with the table", k)
		}
	}
}

// TestCertificatePermissionNames: names are looked up as the table keys
// hosts (lower case, no trailing dot); a pattern matches whole names only;
// the catch-all beside an exact route or pattern grants nothing more; a
// name that is not a valid host name is refused without running a pattern.
func TestCertificatePermissionNames(t *testing.T) {
	r := newRegistry()
	register(t, r, "a", &tunnelpb.Route{Host: "app.test", Target: "http://x:1"},
		&tunnelpb.Route{Host: "::1", Target: "http://x:1"},
		&tunnelpb.Route{HostPattern: `[a-z0-9-]+\.dev\.test`, Target: "http://x:1"})
	register(t, r, "b", &tunnelpb.Route{Target: "http://x:1"}) // catch-all
	tab := r.table.Load()
	for name, want := range map[string]bool{
		"app.test":         true,
		"APP.Test.":        true,
		"::1":              true,
		"pr-7.dev.test":    true,
		"PR-7.DEV.TEST.":   true,
		"dev.test":         false, // the pattern needs a label before
		"a.b.dev.test":     false, // and one label only
		"pr-7.dev.test.io": false,
		"other.test":       false, // only the catch-all serves it
		"app.test..":       false,
		"":                 false,
		".":                false,
	} {
		if got := tab.servesCertificateFor(name); got != want {
			t.Errorf("servesCertificateFor(%q) = %v, want %v", name, got, want)
		}
	}

	// A pattern that matches anything: an invalid name is still refused,
	// and never reaches the pattern (its lookup cache stays empty).
	r = newRegistry()
	register(t, r, "a", &tunnelpb.Route{HostPattern: `(?s).+`, Target: "http://x:1"})
	tab = r.table.Load()
	if !tab.servesCertificateFor("anything.test") {
		t.Fatal("the match-all pattern grants nothing")
	}
	for _, name := range []string{"a b.test", "app.test:443", "a..test", "[::1]", "café.test",
		strings.Repeat("a", 64) + ".test", strings.Repeat("a.", 127) + "a"} {
		if tab.servesCertificateFor(name) {
			t.Errorf("servesCertificateFor(%q) = true for a name that is not a host name", name)
		}
		if _, cached := tab.patterns.cache.get(name); cached {
			t.Errorf("%q ran the patterns", name)
		}
	}
}

// TestCertificatePermissionWithinScope: a pattern route of a scoped
// credential (bound to its scope's names at admission) grants only the
// names it matches within that scope.
func TestCertificatePermissionWithinScope(t *testing.T) {
	within, err := compileNameSet([]string{"*.team.test"})
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry()
	a := &agentSession{agentID: "scoped"}
	entries, rejected := validateRoutes([]*tunnelpb.Route{{HostPattern: `[a-z]+\.[a-z]+\.test`, Target: "http://x:1"}})
	if len(rejected) > 0 {
		t.Fatalf("rejected: %v", rejected)
	}
	entries[0].within = &within // as scope.admitPattern binds it
	entries, _ = r.bind(a, entries, nil)
	r.register(a, entries)
	tab := r.table.Load()
	if !tab.servesCertificateFor("app.team.test") {
		t.Error("a name the pattern matches within the scope is refused")
	}
	if tab.servesCertificateFor("app.other.test") {
		t.Error("a name the pattern matches outside the scope is allowed")
	}
}

// TestCertificatePermissionFollowsTheTable: a host is allowed while an
// agent serves it, not once its session leaves (withdraw) or ends, nor
// after a repeated Advertise drops it.
func TestCertificatePermissionFollowsTheTable(t *testing.T) {
	r := newRegistry()
	a := register(t, r, "a", &tunnelpb.Route{Host: "app.test", Target: "http://x:1"},
		&tunnelpb.Route{HostPattern: `[a-z]+\.dev\.test`, Target: "http://x:1"})
	p := &PermissionBySluice{app: &App{node: &node{reg: r}}}
	for _, name := range []string{"app.test", "x.dev.test"} {
		if err := p.CertificateAllowed(t.Context(), name); err != nil {
			t.Fatalf("%s while agent a serves it: %v", name, err)
		}
	}

	advertise(t, r, a, &tunnelpb.Route{Host: "app.test", Target: "http://x:1"})
	if err := p.CertificateAllowed(t.Context(), "x.dev.test"); err == nil {
		t.Error("x.dev.test allowed after its pattern was withdrawn by a new Advertise")
	}

	b := register(t, r, "b", &tunnelpb.Route{Host: "app.test", Target: "http://x:1"})
	r.withdraw(a)
	if err := p.CertificateAllowed(t.Context(), "app.test"); err != nil {
		t.Errorf("app.test with agent b still serving it: %v", err)
	}
	r.withdraw(b)
	err := p.CertificateAllowed(t.Context(), "app.test")
	if err == nil {
		t.Fatal("app.test allowed while only leaving sessions serve it")
	}
	if !errors.Is(err, caddytls.ErrPermissionDenied) || err.Error() != `sluice: no connected agent serves "app.test"` {
		t.Errorf("refusal %q (a denial: %v)", err, errors.Is(err, caddytls.ErrPermissionDenied))
	}
	r.unregister(a)
	r.unregister(b)
	if tab := r.table.Load(); tab.servesCertificateFor("app.test") || tab.byDial.len() != 0 {
		t.Error("the ended sessions' routes are still in the table")
	}
}

// TestCertificatePermissionRefusals: what each refusal says; an invalid
// name is denied and echoed bounded; without a node the check fails
// closed as an error, not a denial.
func TestCertificatePermissionRefusals(t *testing.T) {
	p := &PermissionBySluice{app: &App{node: &node{reg: newRegistry()}}}
	long := strings.Repeat("x", 70000)
	for _, tc := range []struct{ name, want string }{
		{"nobody.test", `sluice: no connected agent serves "nobody.test"`},
		{"a b.test", `sluice: "a b.test" is not a host name an agent can serve`},
		{long, `sluice: "` + long[:maxRefusedNameShown] + `..." is not a host name an agent can serve`},
	} {
		err := p.CertificateAllowed(t.Context(), tc.name)
		if err == nil || err.Error() != tc.want || !errors.Is(err, caddytls.ErrPermissionDenied) {
			t.Errorf("CertificateAllowed(%.40q) = %v, want the denial %.80q", tc.name, err, tc.want)
		}
	}
	for _, p := range []*PermissionBySluice{{}, {app: &App{}}} {
		err := p.CertificateAllowed(t.Context(), "app.test")
		if err == nil || errors.Is(err, caddytls.ErrPermissionDenied) {
			t.Errorf("without a node: %v, want an error that is not a denial", err)
		}
	}
}

// TestPermissionNeedsTheSluiceApp: a config whose on-demand TLS asks
// sluice but that has no sluice app fails at load, naming the module, and
// does not load a default app (which would generate a token and bind
// :8001).
func TestPermissionNeedsTheSluiceApp(t *testing.T) {
	data := t.TempDir()
	t.Setenv("XDG_DATA_HOME", data)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	cfg := `{"admin": {"disabled": true},
		"apps": {"tls": {"automation": {"on_demand": {"permission": {"module": "sluice"}}}}}}`
	err := caddy.Load([]byte(cfg), true)
	if err == nil {
		caddy.Stop()
		t.Fatal("the config loaded")
	}
	if !strings.Contains(err.Error(), "tls.permission.sluice: needs the sluice app") {
		t.Fatalf("error %q, want it to name tls.permission.sluice and the missing app", err)
	}
	if _, err := os.Stat(filepath.Join(data, "caddy", "sluice", "token")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a sluice app was loaded anyway: its token file: %v", err)
	}
}

// TestPermissionCaddyfile: `permission sluice` takes no arguments and no
// block.
func TestPermissionCaddyfile(t *testing.T) {
	for _, tc := range []struct{ name, perm, want string }{
		{"argument", "permission sluice extra", `permission sluice: takes no arguments, got "extra"`},
		{"block", "permission sluice {\n\t\t\tscope x\n\t\t}", `permission sluice: takes no options, got "scope"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := "{\n\ton_demand_tls {\n\t\t" + tc.perm + "\n\t}\n}\n:443 {\n\ttls internal {\n\t\ton_demand\n\t}\n}\n"
			_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
