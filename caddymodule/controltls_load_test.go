package caddymodule

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// loadConfig loads a config of the sluice app sluice (JSON object body)
// beside a pki app that never touches the trust store, with data in
// temporary directories; it returns Caddy's error.
func loadConfig(t *testing.T, sluice string) error {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	cfg := `{"admin": {"disabled": true}, "apps": {
		"pki": {"certificate_authorities": {"local": {"install_trust": false}}},
		"sluice": {` + sluice + `}}}`
	err := caddy.Load([]byte(cfg), true)
	if err == nil {
		t.Cleanup(func() { caddy.Stop() })
	}
	return err
}

// TestControlTLSRefusedAtLoad: client_auth without TLS on the control
// plane, and tls_internal beside certificate files, fail the load naming
// the fields.
func TestControlTLSRefusedAtLoad(t *testing.T) {
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	ca := newTestCA(t, "files", 24*time.Hour)
	pair := ca.clientCert(t, "urn:x")
	writePEMPair(t, pair, cert, key)
	for _, tc := range []struct{ name, sluice string }{
		{"client_auth without TLS", `"listen": "127.0.0.1:0", "client_auth": {"require": true},
			"credentials": [{"name": "a", "client_identity": "urn:a"}]`},
		{"tls_internal and tls_cert_file", `"listen": "127.0.0.1:0", "token": "load-test-token-0123456789abcdef",
			"tls_internal": {}, "tls_cert_file": "` + cert + `", "tls_key_file": "` + key + `"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := loadConfig(t, tc.sluice)
			if err == nil {
				t.Fatal("the config loaded")
			}
			for _, field := range strings.Split(tc.name, " and ") {
				field = strings.TrimSuffix(field, " without TLS")
				if !strings.Contains(err.Error(), field) {
					t.Errorf("error %q does not name %s", err, field)
				}
			}
		})
	}
}

// writePEMPair writes a certificate and its key as PEM files.
func writePEMPair(t *testing.T, pair tls.Certificate, certPath, keyPath string) {
	t.Helper()
	keyDER, err := x509.MarshalPKCS8PrivateKey(pair.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certPath, []byte(pemString("CERTIFICATE", pair.Certificate[0])), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, []byte(pemString("PRIVATE KEY", keyDER)), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestTLSInternalWithClientAuth: a config with tls_internal and
// client_auth (the pki app's "local" CA) serves a certificate for
// 127.0.0.1 that the CA bundle of an issued client certificate verifies;
// the issue endpoint of the running config issues for the credential; a
// stream with that certificate and no token is served (the tap maps it to
// the credential), and a connection without one is refused at the
// handshake.
func TestTLSInternalWithClientAuth(t *testing.T) {
	err := loadConfig(t, `"listen": "127.0.0.1:0", "tls_internal": {},
		"client_auth": {"require": true},
		"credentials": [{"name": "team-a", "client_identity": "urn:sluice:team-a", "scope": {"hosts": ["app.test"]}}]`)
	if err != nil {
		t.Fatal(err)
	}
	code, body := issueCall(t, &AdminAPI{}, "POST", `{"credential": "team-a", "name": "agent-1", "lifetime": "24h"}`)
	if code != http.StatusOK {
		t.Fatalf("issue: %d %s", code, body)
	}
	var issued IssuedCertificate
	if err := json.Unmarshal([]byte(body), &issued); err != nil {
		t.Fatal(err)
	}
	app, err := runningApp()
	if err != nil {
		t.Fatal(err)
	}
	if app.ctls.clientCA.id != "local" {
		t.Errorf("client_auth CA %q, want local", app.ctls.clientCA.id)
	}
	addr := app.node.listener.Addr().String()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM([]byte(issued.CA)) {
		t.Fatal("no CA in the answer")
	}
	pair, err := tls.X509KeyPair([]byte(issued.Certificate), []byte(issued.Key))
	if err != nil {
		t.Fatal(err)
	}

	if err := listNodes(addr, &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", Certificates: []tls.Certificate{pair}}); err != nil {
		t.Fatalf("ListNodes with the issued certificate: %v", err)
	}
	err = listNodes(addr, &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"})
	if status.Code(err) != codes.Unavailable {
		// Unauthenticated would be the tap's refusal: the handshake let
		// the connection in.
		t.Fatalf("ListNodes without a certificate: %v, want the handshake refused (Unavailable)", err)
	}
}

// listNodes calls ListNodes on the control plane at addr over TLS.
func listNodes(addr string, cfg *tls.Config) error {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		return err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = tunnelpb.NewTunnelClient(cc).ListNodes(ctx, &tunnelpb.ListNodesRequest{})
	return err
}
