package agent

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/credentials"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// writeClientCert writes a throwaway self-signed client certificate of
// the given serial and its key to dir (client.crt, client.key), each
// replaced by a rename as a renewal should, and returns their paths.
func writeClientCert(t testing.TB, dir string, serial int64) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "agent-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	replaceFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	replaceFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	return certFile, keyFile
}

// replaceFile writes data to path through a rename, so that a reader
// sees the old contents or the new, never a part.
func replaceFile(t testing.TB, path string, data []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// peerSerial is the serial of the client certificate ns's stream
// presented, or -1 without one.
func peerSerial(t testing.TB, ns *nodeSession) int64 {
	t.Helper()
	ti, ok := ns.peer.AuthInfo.(credentials.TLSInfo)
	if !ok {
		t.Fatalf("the stream's AuthInfo is %T, not TLS", ns.peer.AuthInfo)
	}
	if certs := ti.State.PeerCertificates; len(certs) > 0 {
		return certs[0].SerialNumber.Int64()
	}
	return -1
}

// certNodeConfig is an agent configuration for a TLS node at addr that
// trusts caPEM and presents the client certificate in dir (serial).
func certNodeConfig(t *testing.T, addr, token string, caPEM []byte, dir string, serial int64) *Config {
	t.Helper()
	cfg := testConfig(addr, token, Upstream{Name: "web", Target: "http://127.0.0.1:1"})
	cfg.Server = "grpcs://" + addr
	cfg.CAFile = writeFile(t, "ca.pem", string(caPEM))
	cfg.CertFile, cfg.KeyFile = writeClientCert(t, dir, serial)
	return cfg
}

// TestClientCertConfig: cert_file and key_file go together, with a
// grpcs:// server, must load, each naming its field, and make the token
// optional.
func TestClientCertConfig(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := writeClientCert(t, dir, 1)
	_, otherKey := writeClientCert(t, t.TempDir(), 2)
	garbage := writeFile(t, "garbage.pem", "not PEM")
	ok := func(c *Config) {}
	for _, tc := range []struct {
		name   string
		mutate func(c *Config)
		want   string // "" for valid
	}{
		{"pair and token", ok, ""},
		{"pair without token", func(c *Config) { c.Token = "" }, ""},
		{"pair with token_file", func(c *Config) { c.Token, c.TokenFile = "", writeFile(t, "token", "t\n") }, ""},
		{"neither, no token", func(c *Config) { c.CertFile, c.KeyFile, c.Token = "", "", "" }, "token: required"},
		{"cert without key", func(c *Config) { c.KeyFile = "" }, "key_file: required with cert_file"},
		{"key without cert", func(c *Config) { c.CertFile = "" }, "cert_file: required with key_file"},
		{"key without cert, no token", func(c *Config) { c.CertFile, c.Token = "", "" }, "cert_file: required with key_file"},
		{"grpc server", func(c *Config) { c.Server = "grpc://tunnel.example.com:8001" }, "cert_file: only valid with a grpcs:// server"},
		{"cert unreadable", func(c *Config) { c.CertFile = "/nonexistent/client.crt" }, "cert_file: open /nonexistent/client.crt"},
		{"key unreadable", func(c *Config) { c.KeyFile = "/nonexistent/client.key" }, "key_file: open /nonexistent/client.key"},
		{"cert not PEM", func(c *Config) { c.CertFile = garbage }, "cert_file: " + garbage + " with key_file " + keyFile + ": tls: "},
		{"key of another cert", func(c *Config) { c.KeyFile = otherKey }, "cert_file: " + certFile + " with key_file " + otherKey + ": tls: private key does not match"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig()
			c.CertFile, c.KeyFile = " "+certFile+" ", keyFile
			tc.mutate(c)
			err := c.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatal(err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("err = %v, want %q", err, tc.want)
			case tc.want != "" && strings.Contains(tc.want, "file") && strings.Contains(err.Error(), "token: required"):
				t.Errorf("err = %v: a client certificate setting makes the token optional", err)
			}
		})
	}
}

// TestClientCertLayers: cert_file and key_file come from the config file,
// the environment or the flags, each file overriding the one below on its
// own; a layer that makes the server grpc:// drops them, as it drops
// ca_file.
func TestClientCertLayers(t *testing.T) {
	fileCert, fileKey := writeClientCert(t, t.TempDir(), 1)
	envCert, envKey := writeClientCert(t, t.TempDir(), 2)
	flagCert, flagKey := writeClientCert(t, t.TempDir(), 3)
	cfgFile := writeFile(t, "agent.yaml", "server: grpcs://a:1\ncert_file: "+fileCert+"\nkey_file: "+fileKey+
		"\nupstreams:\n  - host: a\n    target: http://a:1\n")
	for _, tc := range []struct {
		name               string
		env                map[string]string
		args               []string
		wantCert, wantKey  string
		wantErr, wantToken string
	}{
		{"file", nil, nil, fileCert, fileKey, "", ""},
		{"env", map[string]string{EnvCertFile: envCert, EnvKeyFile: envKey}, nil, envCert, envKey, "", ""},
		{"flags over env", map[string]string{EnvCertFile: envCert, EnvKeyFile: envKey},
			[]string{"-cert-file", flagCert, "-key-file", flagKey}, flagCert, flagKey, "", ""},
		{"renewed cert, same key", nil, []string{"-cert-file", fileCert}, fileCert, fileKey, "", ""},
		{"token beside", map[string]string{EnvToken: "t"}, nil, fileCert, fileKey, "", "t"},
		{"env cert with file key", map[string]string{EnvCertFile: envCert}, nil, "", "", "private key does not match", ""},
		{"plaintext server drops them", map[string]string{EnvServer: "grpc://b:2", EnvToken: "t"}, nil, "", "", "", "t"},
		{"plaintext server and a cert", nil, []string{"-server", "grpc://b:2", "-cert-file", flagCert, "-key-file", flagKey}, "", "", "cert_file: only valid with a grpcs:// server", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{EnvConfig: cfgFile}
			for k, v := range tc.env {
				env[k] = v
			}
			c, err := ParseFlags(tc.args, envFunc(env))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.CertFile != tc.wantCert || c.KeyFile != tc.wantKey || c.Token != tc.wantToken {
				t.Errorf("cert_file %q key_file %q token %q, want %q %q %q", c.CertFile, c.KeyFile, c.Token, tc.wantCert, tc.wantKey, tc.wantToken)
			}
		})
	}
}

// TestClientCertReadBeforeEachAttempt: the agent presents its client
// certificate on the control connection and reads the files again before
// each connection attempt, so a renewed certificate is used at the next
// reconnect; a renewal it cannot read keeps the certificate read before,
// with one warning however many attempts it fails.
func TestClientCertReadBeforeEachAttempt(t *testing.T) {
	caPEM, serverCert := testPKI(t)
	node := newFakeNode(t, "secret", nodeOptions{creds: credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequireAnyClientCert})})
	dir := t.TempDir()
	cfg := certNodeConfig(t, node.addr, "secret", caPEM, dir, 101)
	ag := startAgent(t, cfg)
	ns := node.next(t)
	if got := peerSerial(t, ns); got != 101 {
		t.Fatalf("first attempt presented serial %d, want 101", got)
	}
	if got := ns.md.Get("authorization"); len(got) != 1 || got[0] != "Bearer secret" {
		t.Errorf("authorization %q: with a certificate and a token, both are sent", got)
	}

	writeClientCert(t, dir, 102) // renewed
	ns.cancel()
	ns = node.next(t)
	if got := peerSerial(t, ns); got != 102 {
		t.Fatalf("the attempt after the renewal presented serial %d, want 102", got)
	}
	if !hasLog(ag.logs, "cert_file holds a new certificate", "serial", "66") {
		t.Error("the new certificate was not logged")
	}

	replaceFile(t, cfg.CertFile, []byte("a renewal gone wrong"))
	for range 2 {
		ns.cancel()
		ns = node.next(t)
		if got := peerSerial(t, ns); got != 102 {
			t.Fatalf("with an unreadable cert_file the attempt presented serial %d, want the last good 102", got)
		}
	}
	if n := ag.logs.FilterMessage("cannot read the client certificate; using the one read before").Len(); n != 1 {
		t.Errorf("%d warnings of the unreadable cert_file over two attempts, want 1", n)
	}
}

// TestClientCertWithoutToken: with a client certificate and no token the
// agent sends no authorization (the node takes its credential from the
// certificate), and the "connected" line names the node's credential.
func TestClientCertWithoutToken(t *testing.T) {
	caPEM, serverCert := testPKI(t)
	node := newFakeNode(t, "", nodeOptions{
		creds: credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequireAnyClientCert}),
		ack: func(adv *tunnelpb.Advertise, _ int) *tunnelpb.AdvertiseAck {
			ack := acceptAll(adv)
			ack.Credential = "team-a"
			return ack
		},
	})
	cfg := certNodeConfig(t, node.addr, "", caPEM, t.TempDir(), 7)
	ag := startAgent(t, cfg)
	ns := node.next(t)
	if got := ns.md.Get("authorization"); len(got) != 0 {
		t.Errorf("authorization %q sent without a token", got)
	}
	if got := peerSerial(t, ns); got != 7 {
		t.Errorf("serial %d, want 7", got)
	}
	waitFor(t, 5*time.Second, "the connected line", func() bool { return hasLog(ag.logs, "connected", "credential", "team-a") })
}

// TestClientCertRefusalsAreExplained: the TLS alerts of a node that wants
// a client certificate, or refuses the one presented, come with a hint.
func TestClientCertRefusalsAreExplained(t *testing.T) {
	caPEM, serverCert := testPKI(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM) // the agents' certificates are self-signed: none verifies
	node := newFakeNode(t, "secret", nodeOptions{creds: credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool})})
	withCert := certNodeConfig(t, node.addr, "secret", caPEM, t.TempDir(), 9)
	without := *withCert
	without.CertFile, without.KeyFile, without.Upstreams = "", "", []Upstream{{Name: "web", Target: "http://127.0.0.1:1"}}
	for _, tc := range []struct {
		cfg  *Config
		hint string
	}{
		{&without, "the node requires a client certificate"},
		{withCert, "the node refused the client certificate"},
	} {
		ag := startAgent(t, tc.cfg)
		waitFor(t, 10*time.Second, "a failure with the hint "+tc.hint, func() bool {
			return hasLog(ag.logs, "connection failed; retrying", "hint", tc.hint)
		})
		if err := ag.stop(t); err != nil {
			t.Fatal(err)
		}
	}
}

// laneListener is a TLS listener on loopback that takes data lanes and
// direct sockets as a node does, requiring a client certificate, and
// reports the serial each connection presented.
type laneListener struct {
	addr    string
	serials chan int64
	l       net.Listener
	wg      sync.WaitGroup
}

func newLaneListener(t *testing.T, cert tls.Certificate) *laneListener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ll := &laneListener{addr: l.Addr().String(), serials: make(chan int64, 8), l: l}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAnyClientCert, NextProtos: []string{"h2"}}
	ll.wg.Add(1)
	go func() {
		defer ll.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			ll.wg.Add(1)
			go func() {
				defer ll.wg.Done()
				ll.serve(tls.Server(c, tc))
			}()
		}
	}()
	t.Cleanup(func() { l.Close(); ll.wg.Wait() })
	return ll
}

// serve takes one connection: the handshake, the hello, LaneAccepted,
// then what the agent sends until it closes.
func (ll *laneListener) serve(c *tls.Conn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if c.Handshake() != nil {
		return
	}
	ll.serials <- c.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
	if _, err := c.Read(make([]byte, 256)); err != nil {
		return
	}
	c.Write([]byte{tunnelpb.LaneAccepted})
	io.Copy(io.Discard, c)
}

// TestLanesPresentTheAttemptsCertificate: the data lane and the direct
// sockets present the client certificate of their session's attempt, even
// after the files changed (they are not read again per socket); the next
// attempt presents the new one.
func TestLanesPresentTheAttemptsCertificate(t *testing.T) {
	caPEM, serverCert := testPKI(t)
	ll := newLaneListener(t, serverCert)
	dir := t.TempDir()
	cfg := certNodeConfig(t, ll.addr, "secret", caPEM, dir, 201)
	core, _ := observer.New(zap.DebugLevel)
	a, err := New(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	creds := a.attemptCredentials()
	writeClientCert(t, dir, 202) // renewed while the session runs

	dial := func(creds credentials.TransportCredentials, hello []byte) int64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := dialLane(ctx, creds, 0, ll.addr, ll.addr, hello)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		select {
		case s := <-ll.serials:
			return s
		case <-ctx.Done():
			t.Fatal("the listener saw no certificate")
			return 0
		}
	}
	ticket, key := strings.Repeat("t", tunnelpb.LaneTicketLength), strings.Repeat("ab", tunnelpb.DirectKeyLength/2)
	if got := dial(creds, tunnelpb.LaneHello(ticket)); got != 201 {
		t.Errorf("the lane presented serial %d, want the attempt's 201", got)
	}
	if got := dial(creds, tunnelpb.DirectHello(key, 1)); got != 201 {
		t.Errorf("a direct socket presented serial %d, want the attempt's 201", got)
	}
	if got := dial(a.attemptCredentials(), tunnelpb.LaneHello(ticket)); got != 202 {
		t.Errorf("the next attempt's lane presented serial %d, want 202", got)
	}
}

// TestNewRejectsAnUnreadableKeyFile: New fails naming the field.
func TestNewRejectsAnUnreadableKeyFile(t *testing.T) {
	caPEM, _ := testPKI(t)
	cfg := certNodeConfig(t, "127.0.0.1:1", "secret", caPEM, t.TempDir(), 1)
	if err := os.Remove(cfg.KeyFile); err != nil {
		t.Fatal(err)
	}
	_, err := New(cfg, nil)
	if !errors.Is(err, os.ErrNotExist) || !strings.HasPrefix(err.Error(), "key_file: ") {
		t.Fatalf("New: %v", err)
	}
}
