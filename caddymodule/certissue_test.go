package caddymodule

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/big"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// testCA is a CA for tests: a self-signed P-256 root valid for lifetime,
// whose key loads count.
type testCA struct {
	*signingCA
	key   *ecdsa.PrivateKey
	loads atomic.Int64 // root key loads: one per signature
	fail  atomic.Bool  // the root key does not load
}

func newTestCA(t testing.TB, name string, lifetime time.Duration) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name + " Root"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(lifetime),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	root, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &testCA{key: key}
	ca.signingCA = &signingCA{id: name, root: root, rootKey: func() (crypto.Signer, error) {
		ca.loads.Add(1)
		if ca.fail.Load() {
			return nil, errors.New("storage unavailable")
		}
		return key, nil
	}}
	return ca
}

// pool is a pool of the CA's root.
func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.root)
	return p
}

// clientCert issues a client certificate for identity, as tls.Certificate.
func (ca *testCA) clientCert(t testing.TB, identity string) tls.Certificate {
	t.Helper()
	out, err := issueClientCert(ca.signingCA, issueParams{cred: &credential{name: "c", identity: identity}, name: "agent", lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair([]byte(out.Certificate), []byte(out.Key))
	if err != nil {
		t.Fatal(err)
	}
	return pair
}

func parsePEMCert(t testing.TB, s string) *x509.Certificate {
	t.Helper()
	b, rest := pem.Decode([]byte(s))
	if b == nil || b.Type != "CERTIFICATE" || strings.TrimSpace(string(rest)) != "" {
		t.Fatalf("want one PEM certificate, got %q", s)
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestIssueClientCertificate: an issued certificate carries the
// credential's identity where the tap reads it (a URI SAN for a URI, a DNS
// SAN otherwise), the name as CN, client auth as its only usage, a random
// 128-bit serial, the asked lifetime, and verifies as a client certificate
// against the pool of the CA bundle it comes with; its key is its own.
func TestIssueClientCertificate(t *testing.T) {
	ca := newTestCA(t, "issue", 365*24*time.Hour)
	for _, tc := range []struct {
		identity string
		uri      bool
	}{
		{"urn:sluice:team-a", true},
		{"spiffe://example.com/agents/team-a", true},
		{"team-b.agents.internal", false},
	} {
		t.Run(tc.identity, func(t *testing.T) {
			now := time.Now()
			out, err := issueClientCert(ca.signingCA, issueParams{
				cred: &credential{name: "team", identity: tc.identity}, name: "laptop-1", lifetime: 48 * time.Hour,
			}, now)
			if err != nil {
				t.Fatal(err)
			}
			leaf := parsePEMCert(t, out.Certificate)
			if tc.uri && (len(leaf.URIs) != 1 || leaf.URIs[0].String() != tc.identity || len(leaf.DNSNames) != 0) {
				t.Errorf("URI identity: URIs %v DNS %v", leaf.URIs, leaf.DNSNames)
			}
			if !tc.uri && (!slices.Equal(leaf.DNSNames, []string{tc.identity}) || len(leaf.URIs) != 0) {
				t.Errorf("DNS identity: URIs %v DNS %v", leaf.URIs, leaf.DNSNames)
			}
			if !slices.Contains(certIdentities(leaf), tc.identity) {
				t.Errorf("the tap reads identities %v, want %q among them", certIdentities(leaf), tc.identity)
			}
			if leaf.Subject.CommonName != "laptop-1" || leaf.IsCA || leaf.KeyUsage != x509.KeyUsageDigitalSignature ||
				!slices.Equal(leaf.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}) {
				t.Errorf("CN %q IsCA %v KeyUsage %v ExtKeyUsage %v", leaf.Subject.CommonName, leaf.IsCA, leaf.KeyUsage, leaf.ExtKeyUsage)
			}
			if leaf.SerialNumber.BitLen() > 128 || leaf.SerialNumber.Sign() <= 0 || out.Serial != SerialHex(leaf.SerialNumber) {
				t.Errorf("serial %v (%d bits), answer says %q", leaf.SerialNumber, leaf.SerialNumber.BitLen(), out.Serial)
			}
			if d := leaf.NotAfter.Sub(now.Add(48 * time.Hour)); d < -time.Second || d > time.Second {
				t.Errorf("NotAfter %v, want now+48h", leaf.NotAfter)
			}
			if out.NotAfter != leaf.NotAfter.UTC().Format(time.RFC3339) || out.Identity != tc.identity || out.Credential != "team" {
				t.Errorf("answer %+v", out)
			}
			bundle := x509.NewCertPool()
			if !bundle.AppendCertsFromPEM([]byte(out.CA)) {
				t.Fatal("the CA bundle holds no certificate")
			}
			if _, err := leaf.Verify(x509.VerifyOptions{Roots: bundle, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
				t.Errorf("the certificate does not verify against its CA bundle: %v", err)
			}
			if _, err := leaf.Verify(x509.VerifyOptions{Roots: bundle, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
				t.Error("a client certificate verifies as a server certificate")
			}
			if _, err := tls.X509KeyPair([]byte(out.Certificate), []byte(out.Key)); err != nil {
				t.Errorf("key and certificate do not pair: %v", err)
			}
			if b, _ := pem.Decode([]byte(out.Key)); b == nil || b.Type != "PRIVATE KEY" {
				t.Errorf("key is not PKCS#8 PEM: %q", out.Key[:min(len(out.Key), 40)])
			}
		})
	}
	// Two issuances never share a serial.
	a, b := ca.clientCert(t, "urn:x"), ca.clientCert(t, "urn:x")
	if a.Leaf.SerialNumber.Cmp(b.Leaf.SerialNumber) == 0 {
		t.Error("two certificates got the same serial")
	}
}

// TestIssueRefusesWhatCannotWork: a lifetime past the root, and an
// identity that would not read back as configured, are refused as bad
// requests, before anything is signed.
func TestIssueRefusesWhatCannotWork(t *testing.T) {
	ca := newTestCA(t, "short", 24*time.Hour)
	_, err := issueClientCert(ca.signingCA, issueParams{cred: &credential{name: "c", identity: "urn:c"}, name: "n", lifetime: 48 * time.Hour}, time.Now())
	if bad := (badIssue{}); !errors.As(err, &bad) || !errors.Is(err, errPastRoot) || !strings.Contains(err.Error(), "lifetime") {
		t.Errorf("lifetime past the root: %v", err)
	}
	for _, id := range []string{"URN:sluice:upper", "Team.Example.com"} {
		_, err := issueClientCert(ca.signingCA, issueParams{cred: &credential{name: "c", identity: id}, name: "n", lifetime: time.Hour}, time.Now())
		if bad := (badIssue{}); !errors.As(err, &bad) || !strings.Contains(err.Error(), "client_identity") {
			t.Errorf("identity %q: %v", id, err)
		}
	}
	if n := ca.loads.Load(); n != 0 {
		t.Errorf("refused requests loaded the root key %d times", n)
	}
}

// issueApp is an App with client_auth under ca and credentials team-a
// (with a client identity) and token-only (without), logging into logs.
func issueApp(t *testing.T, ca *testCA) (*App, *observer.ObservedLogs) {
	t.Helper()
	creds, err := buildCredentials("", []*Credential{
		{Name: "team-a", ClientIdentity: "urn:sluice:team-a", Scope: Scope{Hosts: []string{"app.test"}}},
		{Name: "token-only", Token: "token-only-0123456789abcdef0123456789", Scope: Scope{Hosts: []string{"b.test"}}},
	}, &ClientAuth{})
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	c := &controlTLS{}
	c.withClientAuth(ca.signingCA, true)
	return &App{ctls: c, creds: creds, logger: zap.New(core)}, logs
}

// issueCall sends body to /sluice/certificates of api, as Caddy's admin
// server would (an error becomes its status), and returns the status and
// body.
func issueCall(t *testing.T, api *AdminAPI, method, body string) (int, string) {
	t.Helper()
	req := httptest.NewRequest(method, "/sluice/certificates", strings.NewReader(body))
	for _, rt := range api.Routes() {
		if rt.Pattern != req.URL.Path {
			continue
		}
		rec := httptest.NewRecorder()
		if err := rt.Handler.ServeHTTP(rec, req); err != nil {
			var apiErr caddy.APIError
			if !errors.As(err, &apiErr) {
				t.Fatalf("%s: %v is not an APIError", method, err)
			}
			return apiErr.HTTPStatus, apiErr.Err.Error()
		}
		return rec.Code, rec.Body.String()
	}
	t.Fatal("no /sluice/certificates route")
	return 0, ""
}

// TestIssueEndpoint: POST /sluice/certificates issues for a credential
// with a client identity and logs it without the key; what it cannot
// serve is a 400 saying why, other methods a 405.
func TestIssueEndpoint(t *testing.T) {
	ca := newTestCA(t, "api", 365*24*time.Hour)
	app, logs := issueApp(t, ca)
	api := &AdminAPI{app: func() (*App, error) { return app, nil }}

	code, body := issueCall(t, api, "POST", `{"credential": "team-a", "name": "laptop", "lifetime": "720h"}`)
	if code != http.StatusOK {
		t.Fatalf("issue: %d %s", code, body)
	}
	var out IssuedCertificate
	if err := json.Unmarshal([]byte(body), &out); err != nil {
		t.Fatal(err)
	}
	leaf := parsePEMCert(t, out.Certificate)
	if out.Credential != "team-a" || out.Identity != "urn:sluice:team-a" || leaf.Subject.CommonName != "laptop" ||
		out.Serial != SerialHex(leaf.SerialNumber) || !parsePEMCert(t, out.CA).Equal(ca.root) {
		t.Fatalf("answer %+v", out)
	}
	lines := logs.FilterMessage("sluice: issued a client certificate").All()
	if len(lines) != 1 {
		t.Fatalf("issuance logged %d times", len(lines))
	}
	fields := lines[0].ContextMap()
	if fields["credential"] != "team-a" || fields["name"] != "laptop" || fields["serial"] != out.Serial || fields["not_after"] != out.NotAfter {
		t.Errorf("issuance log fields %v", fields)
	}
	for _, e := range logs.All() {
		for _, v := range e.ContextMap() {
			if s, ok := v.(string); ok && strings.Contains(s, "PRIVATE KEY") {
				t.Fatal("a log line holds the key")
			}
		}
	}

	for _, tc := range []struct{ name, method, body, want string }{
		{"unknown credential", "POST", `{"credential": "nobody"}`, `no credential named "nobody"`},
		{"no credential", "POST", `{}`, "credential: required"},
		{"credential without identity", "POST", `{"credential": "token-only"}`, "has no client_identity"},
		{"bad lifetime", "POST", `{"credential": "team-a", "lifetime": "soon"}`, "lifetime"},
		{"negative lifetime", "POST", `{"credential": "team-a", "lifetime": "-1h"}`, "lifetime"},
		{"lifetime past the root", "POST", `{"credential": "team-a", "lifetime": "87600h"}`, "ends after the root"},
		{"bad name", "POST", `{"credential": "team-a", "name": "../x"}`, "name:"},
		{"unknown field", "POST", `{"credential": "team-a", "ttl": "1h"}`, "unknown field"},
		{"not JSON", "POST", `credential=team-a`, "decoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := issueCall(t, api, tc.method, tc.body)
			if code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
				t.Errorf("%d %q, want 400 with %q", code, body, tc.want)
			}
		})
	}
	for _, m := range []string{"GET", "PUT", "DELETE"} {
		if code, _ := issueCall(t, api, m, ""); code != http.StatusMethodNotAllowed {
			t.Errorf("%s: %d, want 405", m, code)
		}
	}

	// Without client_auth there is no CA to sign with.
	app.ctls = &controlTLS{}
	if code, body := issueCall(t, api, "POST", `{"credential": "team-a"}`); code != http.StatusBadRequest || !strings.Contains(body, "client_auth") {
		t.Errorf("without client_auth: %d %q", code, body)
	}
	app.ctls = nil
	if code, body := issueCall(t, api, "POST", `{"credential": "team-a"}`); code != http.StatusBadRequest || !strings.Contains(body, "client_auth") {
		t.Errorf("plaintext node: %d %q", code, body)
	}
	// A CA whose key cannot be read is the server's fault.
	app.ctls = &controlTLS{clientCA: ca.signingCA}
	ca.fail.Store(true)
	if code, _ := issueCall(t, api, "POST", `{"credential": "team-a"}`); code != http.StatusInternalServerError {
		t.Errorf("unreadable root key: %d, want 500", code)
	}
}
