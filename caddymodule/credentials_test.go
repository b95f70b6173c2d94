package caddymodule

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// storeToken gives n the unscoped token tok as its only credential.
func storeToken(t testing.TB, n *node, tok string) {
	t.Helper()
	set, err := buildCredentials(tok, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	n.creds.Store(set)
}

const (
	tokenA = "team-a-token-0123456789abcdef0123"
	tokenB = "team-b-token-0123456789abcdef0123"
)

// twoTeams is a credential set of the unscoped token and teams a and b.
func twoTeams(t *testing.T) *credentialSet {
	t.Helper()
	set, err := buildCredentials("unscoped-token-0123456789abcdef01", []*Credential{
		{Name: "team-a", Token: tokenA, Scope: Scope{Hosts: []string{"app.test", "*.a.test"}, AllowPatterns: true,
			Services: []string{"redis-a"}, ServerNames: []string{"tls.a.test"}, Ports: "16000-16009"}},
		{Name: "team-b", Token: tokenB, Scope: Scope{Hosts: []string{"*.b.test"}}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return set
}

func bearer(tok string) metadata.MD { return metadata.Pairs("authorization", "Bearer "+tok) }

func TestIdentifyPicksTheCredentialOfTheToken(t *testing.T) {
	n := testNode(t)
	n.creds.Store(twoTeams(t))
	for tok, want := range map[string]string{tokenA: "team-a", tokenB: "team-b", "unscoped-token-0123456789abcdef01": ""} {
		au, ok := n.identify(context.Background(), bearer(tok))
		if !ok || au.cred.name != want {
			t.Errorf("token of %q: got %v %v", want, au.cred, ok)
		}
	}
	for _, md := range []metadata.MD{bearer("nope"), bearer(tokenA[:len(tokenA)-1]), metadata.MD{}} {
		if _, ok := n.identify(context.Background(), md); ok {
			t.Errorf("%v authenticated", md)
		}
	}
}

func TestBuildCredentialsNamesTheField(t *testing.T) {
	tokenFile := filepath.Join(t.TempDir(), "tok")
	if err := os.WriteFile(tokenFile, []byte(tokenA+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		creds []*Credential
		auth  *ClientAuth
		want  string
	}{
		{"no name", []*Credential{{Token: tokenA}}, nil, "credentials[0]: name: required"},
		{"no secret", []*Credential{{Name: "a"}}, nil, `credential "a": needs token, token_file or client_identity`},
		{"both token forms", []*Credential{{Name: "a", Token: tokenA, TokenFile: tokenFile}}, nil, "token and token_file are mutually exclusive"},
		{"same name", []*Credential{{Name: "a", Token: tokenA}, {Name: "a", Token: tokenB}}, nil, `name "a" is used twice`},
		{"same token", []*Credential{{Name: "a", Token: tokenA}, {Name: "b", TokenFile: tokenFile}}, nil, `credential "b": its token is also a's`},
		{"token of the unscoped", []*Credential{{Name: "a", Token: "unscoped-token-0123456789abcdef01"}}, nil, `its token is also (token)'s`},
		{"identity without client_auth", []*Credential{{Name: "a", ClientIdentity: "urn:x"}}, nil, "client_identity needs client_auth"},
		{"same identity", []*Credential{{Name: "a", ClientIdentity: "urn:x"}, {Name: "b", ClientIdentity: "urn:x"}}, &ClientAuth{}, `client_identity "urn:x" is also a's`},
		{"bad wildcard", []*Credential{{Name: "a", Token: tokenA, Scope: Scope{Hosts: []string{"app.*.test"}}}}, nil, `scope: hosts: "app.*.test"`},
		{"bad host", []*Credential{{Name: "a", Token: tokenA, Scope: Scope{ServerNames: []string{"bad host"}}}}, nil, "scope: server_names:"},
		{"bad ports", []*Credential{{Name: "a", Token: tokenA, Scope: Scope{Ports: "9-1"}}}, nil, "scope: ports:"},
		{"bad serial", nil, &ClientAuth{RevokedSerials: []string{"xyz"}}, `revoked_serials: "xyz" is not a hexadecimal serial number`},
	} {
		_, err := buildCredentials("unscoped-token-0123456789abcdef01", tc.creds, tc.auth)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

func TestNameSetWildcards(t *testing.T) {
	s, err := compileNameSet([]string{"App.test.", "*.team.test"})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{"app.test": true, "x.team.test": true, "a.b.team.test": true,
		"team.test": false, "xteam.test": false, "other.test": false} {
		if got := s.contains(host); got != want {
			t.Errorf("contains(%q) = %v, want %v", host, got, want)
		}
	}
	all, _ := compileNameSet([]string{"*"})
	if !all.contains("anything.test") {
		t.Error(`"*" does not contain every host`)
	}
}

// TestScopeDecidesEachKind: each kind of route is checked against its part
// of the scope, and a rejection names the part.
func TestScopeDecidesEachKind(t *testing.T) {
	sc := twoTeams(t).byName["team-a"].scope
	for _, tc := range []struct {
		rt   *tunnelpb.Route
		want string // "" in scope
	}{
		{&tunnelpb.Route{Host: "app.test", Target: "http://x"}, ""},
		{&tunnelpb.Route{Host: "deep.x.a.test", Target: "tcp://x"}, ""},
		{&tunnelpb.Route{Host: "app.b.test", Target: "http://x"}, `host "app.b.test" is not among its hosts`},
		{&tunnelpb.Route{HostPattern: `[a-z]+\.a\.test`, Target: "http://x"}, ""},
		{&tunnelpb.Route{Host: "tls.a.test", TlsPassthrough: true, Target: "tcp://x"}, ""},
		{&tunnelpb.Route{Host: "app.test", TlsPassthrough: true, Target: "tcp://x"}, `TLS server name "app.test"`},
		{&tunnelpb.Route{Name: "redis-a", Target: "tcp://x"}, ""},
		{&tunnelpb.Route{Name: "redis-b", Target: "tcp://x"}, `TCP service "redis-b"`},
		{&tunnelpb.Route{Target: "http://x"}, "catch-all route is not allowed"},
		{&tunnelpb.Route{ListenPort: 16005, Target: "tcp://x"}, ""},
		{&tunnelpb.Route{ListenPort: 16010, Target: "tcp://x"}, "listen port 16010 is outside its ports 16000-16009"},
	} {
		entries, rejected := validateRoutes([]*tunnelpb.Route{tc.rt})
		if len(rejected) > 0 {
			t.Fatalf("%v: %v", tc.rt, rejected)
		}
		got := sc.admitScope(entries[0])
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%v: got %q, want %q", tc.rt, got, tc.want)
		}
	}
	b := twoTeams(t).byName["team-b"].scope
	entries, _ := validateRoutes([]*tunnelpb.Route{{HostPattern: `.*`}})
	if got := b.admitScope(entries[0]); !strings.Contains(got, "host patterns are not allowed") {
		t.Errorf("pattern without allow_patterns: %q", got)
	}
}

// TestScopedPatternMatchesOnlyItsHosts: a pattern route of a scoped
// credential never matches a host outside the scope, whatever its pattern
// says, and a broad pattern of another agent still does.
func TestScopedPatternMatchesOnlyItsHosts(t *testing.T) {
	r := newRegistry()
	set := twoTeams(t)
	a := &agentSession{agentID: "a", credName: "team-a", auth: authn{cred: set.byName["team-a"]}}
	entries, _ := validateRoutes([]*tunnelpb.Route{{HostPattern: `.*`, Target: "http://x"}})
	if reason := a.scope().admitScope(entries[0]); reason != "" {
		t.Fatal(reason)
	}
	entries, _ = r.bind(a, entries, nil)
	r.register(a, entries)
	tbl := r.table.Load()
	for host, want := range map[string]bool{"x.a.test": true, "app.test": true, "x.b.test": false, "evil.test": false} {
		if got := len(tbl.lookupHTTP(host)) > 0; got != want {
			t.Errorf("lookupHTTP(%q) served: %v, want %v", host, got, want)
		}
	}
}

// TestAgentsOfTwoCredentialsKeepTheirSessions: the same id under two
// credentials is two agents; under one credential the newer replaces.
func TestAgentsOfTwoCredentialsKeepTheirSessions(t *testing.T) {
	r := newRegistry()
	set := twoTeams(t)
	mk := func(cred string) *agentSession {
		return &agentSession{agentID: "agent-1", credName: cred, auth: authn{cred: set.byName[cred]}}
	}
	a, b := mk("team-a"), mk("team-b")
	if old := r.register(a, nil); old != nil {
		t.Fatal("first registration replaced a session")
	}
	if old := r.register(b, nil); old != nil {
		t.Fatalf("team-b's agent-1 replaced team-a's")
	}
	if !r.succeeds(agentKey{"team-a", "agent-1"}) || r.succeeds(agentKey{"team-c", "agent-1"}) {
		t.Error("succeeds does not key by credential")
	}
	a2 := mk("team-a")
	if old := r.register(a2, nil); old != a {
		t.Fatalf("team-a's second agent-1 replaced %v, want team-a's first", old)
	}
	if len(r.sessions()) != 2 {
		t.Errorf("sessions: %d, want 2", len(r.sessions()))
	}
}

// TestStillValidFollowsTheReload: a session stays valid while its
// credential keeps its name and secret; a changed token, a removed
// credential or a revoked serial end it.
func TestStillValidFollowsTheReload(t *testing.T) {
	set := twoTeams(t)
	au := authn{cred: set.byName["team-a"], tokenSum: sha256.Sum256([]byte(tokenA))}
	if !set.stillValid(au) {
		t.Fatal("valid session invalid under its own set")
	}
	rescoped, _ := buildCredentials("", []*Credential{{Name: "team-a", Token: tokenA, Scope: Scope{Hosts: []string{"*"}}}}, nil)
	if !rescoped.stillValid(au) {
		t.Error("a scope change invalidated the session")
	}
	rotated, _ := buildCredentials("", []*Credential{{Name: "team-a", Token: tokenB}}, nil)
	if rotated.stillValid(au) {
		t.Error("a rotated token kept the session")
	}
	gone, _ := buildCredentials("", []*Credential{{Name: "team-b", Token: tokenB}}, nil)
	if gone.stillValid(au) {
		t.Error("a removed credential kept the session")
	}
	certSet, _ := buildCredentials("", []*Credential{{Name: "edge", ClientIdentity: "urn:edge"}}, &ClientAuth{})
	cau := authn{cred: certSet.byName["edge"], serial: "1a2b", ca: "local"}
	if !certSet.stillValid(cau) {
		t.Fatal("certificate session invalid under its own set")
	}
	revoked, _ := buildCredentials("", []*Credential{{Name: "edge", ClientIdentity: "urn:edge"}}, &ClientAuth{RevokedSerials: []string{"1A:2B"}})
	if revoked.stillValid(cau) {
		t.Error("a revoked serial kept the session")
	}
	otherCA, _ := buildCredentials("", []*Credential{{Name: "edge", ClientIdentity: "urn:edge"}}, &ClientAuth{CA: "agents"})
	if otherCA.stillValid(cau) {
		t.Error("a certificate of the CA a reload replaced kept the session")
	}
	tokenAu := authn{cred: certSet.byName["edge"], tokenSum: sha256.Sum256([]byte(tokenA))}
	withToken, _ := buildCredentials("", []*Credential{{Name: "edge", Token: tokenA, ClientIdentity: "urn:edge"}}, &ClientAuth{})
	required, _ := buildCredentials("", []*Credential{{Name: "edge", Token: tokenA, ClientIdentity: "urn:edge"}}, &ClientAuth{Require: true})
	if !withToken.stillValid(tokenAu) || required.stillValid(tokenAu) {
		t.Error("turning require on did not end a session that came with a token alone")
	}
}

// TestRequireRefusesTokensAlone: with client_auth's require a token
// without a credential's certificate does not authenticate.
func TestRequireRefusesTokensAlone(t *testing.T) {
	n := testNode(t)
	set, err := buildCredentials("", []*Credential{{Name: "a", Token: tokenA}}, &ClientAuth{Require: true})
	if err != nil {
		t.Fatal(err)
	}
	n.creds.Store(set)
	if _, ok := n.identify(context.Background(), bearer(tokenA)); ok {
		t.Error("a token alone authenticated with require")
	}
}

// TestServiceNamesStayInScope: a route of a scoped credential named like a
// service its scope does not list is not reached by that name (layer4's
// `sluice NAME`), whatever its kind; one of the unscoped token is.
func TestServiceNamesStayInScope(t *testing.T) {
	r := newRegistry()
	set := twoTeams(t)
	n := testNode(t)
	n.reg = r
	a := &agentSession{agentID: "0-a", credName: "team-a", auth: authn{cred: set.byName["team-a"]}}
	entries, _ := validateRoutes([]*tunnelpb.Route{{Name: "postgres", Host: "app.test", Target: "http://x"}, {Name: "redis-a", Target: "tcp://x"}})
	entries, rejected := n.admitScoped(a, entries)
	if len(rejected) != 0 {
		t.Fatalf("rejected: %v", rejected)
	}
	entries, _ = r.bind(a, entries, nil)
	r.register(a, entries)
	tbl := r.table.Load()
	if es := tbl.lookupName("postgres"); len(es) != 0 {
		t.Errorf("a host route named postgres answers `sluice postgres`: %s", agentsOf(es))
	}
	if es := tbl.lookupName("redis-a"); len(es) != 1 {
		t.Errorf("the credential's own service: %s", agentsOf(es))
	}
	if es := tbl.lookupName("app.test"); len(es) != 1 {
		t.Errorf("the host itself by name: %s", agentsOf(es))
	}
}

func TestSerialKeyOfNormalises(t *testing.T) {
	for in, want := range map[string]string{"1A:2B:3C": "1a2b3c", "0x00ff": "ff", " 0a:0b ": "a0b"} {
		if got, err := serialKeyOf(in); err != nil || got != want {
			t.Errorf("serialKeyOf(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// TestDNSIdentityNeedsALeafOfTheRoot: a DNS identity selects its
// credential only on a certificate the root signed itself (issue-cert's);
// under an intermediate (Caddy's tls internal sites, an acme_server) it
// selects none, while a URI identity does either way.
func TestDNSIdentityNeedsALeafOfTheRoot(t *testing.T) {
	set, err := buildCredentials("", []*Credential{
		{Name: "dns", ClientIdentity: "agent.example.com"},
		{Name: "uri", ClientIdentity: "urn:sluice:uri"},
	}, &ClientAuth{})
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse("urn:sluice:uri")
	root, inter := &x509.Certificate{}, &x509.Certificate{}
	dnsLeaf := &x509.Certificate{DNSNames: []string{"agent.example.com"}}
	uriLeaf := &x509.Certificate{URIs: []*url.URL{u}}
	for _, tc := range []struct {
		chain []*x509.Certificate
		want  string
	}{
		{[]*x509.Certificate{dnsLeaf, root}, "dns"},
		{[]*x509.Certificate{dnsLeaf, inter, root}, ""},
		{[]*x509.Certificate{uriLeaf, root}, "uri"},
		{[]*x509.Certificate{uriLeaf, inter, root}, "uri"},
	} {
		got := ""
		if c := set.byCertificate(tc.chain); c != nil {
			got = c.name
		}
		if got != tc.want {
			t.Errorf("chain of %d with %v %v: credential %q, want %q", len(tc.chain), tc.chain[0].DNSNames, tc.chain[0].URIs, got, tc.want)
		}
	}
}

// BenchmarkAdmitScope is the scope's cost for one Advertise of the most
// routes one may carry, against a scope of 64 exact hosts and 16 suffixes.
func BenchmarkAdmitScope(b *testing.B) {
	hosts := []string{}
	for i := range 64 {
		hosts = append(hosts, fmt.Sprintf("app-%d.example.com", i))
	}
	for i := range 16 {
		hosts = append(hosts, fmt.Sprintf("*.team-%d.example.com", i))
	}
	set, err := buildCredentials("", []*Credential{{Name: "t", Token: tokenA, Scope: Scope{Hosts: hosts}}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	routes := make([]*tunnelpb.Route, maxRoutesPerAdvertise)
	for i := range routes {
		routes[i] = &tunnelpb.Route{Host: fmt.Sprintf("svc-%d.team-%d.example.com", i, i%20), Target: "http://x"}
	}
	entries, _ := validateRoutes(routes)
	sc := set.byName["t"].scope
	b.ResetTimer()
	for range b.N {
		for _, e := range entries {
			sc.admitScope(e)
		}
	}
}
