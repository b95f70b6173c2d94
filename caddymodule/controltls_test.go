package caddymodule

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"
)

// serverTLS is a control plane's TLS under ca: a tls_internal certificate
// for 127.0.0.1, and client_auth (require or if-given) when auth is set.
func serverTLS(t *testing.T, ca *testCA, auth *ClientAuth) *controlTLS {
	t.Helper()
	ic, err := (&InternalTLS{Names: []string{"127.0.0.1"}}).provision(ca.signingCA, caddy.NetworkAddress{}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	c := &controlTLS{internal: ic}
	if auth != nil {
		c.withClientAuth(ca.signingCA, auth.Require)
	}
	return c
}

// tlsHandshake runs one TLS handshake from a client (presenting cert unless
// nil, trusting serverCA's root) to the node's transport credentials, as
// an agent's connection meets them, and returns the server's view.
func tlsHandshake(t *testing.T, n *tlsTestNode, serverCA *testCA, cert *tls.Certificate, sessions tls.ClientSessionCache) (credentials.TLSInfo, error) {
	t.Helper()
	server, client := tcpPair(t) // not net.Pipe: both ends write at once in a resumption
	defer server.Close()
	defer client.Close()
	cfg := &tls.Config{RootCAs: serverCA.pool(), ServerName: "127.0.0.1", NextProtos: []string{"h2"}, ClientSessionCache: sessions}
	if cert != nil {
		// Sent whatever CAs the server names, as a client that does not
		// look would (Go's client skips a certificate of another CA).
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	}
	done := make(chan error, 1)
	go func() {
		defer client.Close() // as a refused client does
		c := tls.Client(client, cfg)
		err := c.Handshake()
		if err == nil {
			// TLS 1.3: the server verifies the client's certificate after
			// the client's handshake returned; a read sees its verdict
			// (and takes the session ticket).
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = c.Read(make([]byte, 1))
		}
		done <- err
	}()
	_, ai, err := n.creds.ServerHandshake(server)
	if err != nil {
		client.Close()
		<-done
		return credentials.TLSInfo{}, err
	}
	server.Close() // the client's read ends
	<-done
	return ai.(credentials.TLSInfo), nil
}

// tcpPair is the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (server, client net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if server, err = ln.Accept(); err != nil {
		t.Fatal(err)
	}
	return server, client
}

// tlsTestNode is a node serving ctls (not listening) and its transport
// credentials, made once as newNode makes them (session tickets are
// encrypted with keys of the credentials' config).
type tlsTestNode struct {
	*node
	creds credentials.TransportCredentials
}

func tlsNode(ctls *controlTLS) *tlsTestNode {
	n := newNode("tls-test", ctls, zap.NewNop())
	return &tlsTestNode{node: n, creds: n.tlsCreds()}
}

// TestClientAuthModes: with require, a handshake without a certificate is
// refused; with if-given it passes without an identity; either way a
// certificate of the client_auth CA is verified (the tap reads it from
// VerifiedChains) and one of another CA is refused. Without client_auth
// no certificate is asked for.
func TestClientAuthModes(t *testing.T) {
	ca, other := newTestCA(t, "sluice", 30*24*time.Hour), newTestCA(t, "other", 30*24*time.Hour)
	good, foreign := ca.clientCert(t, "urn:sluice:a"), other.clientCert(t, "urn:sluice:a")
	for _, tc := range []struct {
		name                       string
		auth                       *ClientAuth
		noCert, goodCert, foreignC bool // handshake succeeds
		verified                   bool // the good certificate is verified
	}{
		{"require", &ClientAuth{Require: true}, false, true, false, true},
		{"if given", &ClientAuth{}, true, true, false, true},
		{"no client_auth", nil, true, true, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := tlsNode(serverTLS(t, ca, tc.auth))
			if _, err := tlsHandshake(t, n, ca, nil, nil); (err == nil) != tc.noCert {
				t.Errorf("without a certificate: %v", err)
			}
			info, err := tlsHandshake(t, n, ca, &good, nil)
			if (err == nil) != tc.goodCert {
				t.Fatalf("with the CA's certificate: %v", err)
			}
			if got := len(info.State.VerifiedChains) > 0; got != tc.verified {
				t.Errorf("verified chains: %v, want %v", got, tc.verified)
			} else if got && !info.State.VerifiedChains[0][0].Equal(good.Leaf) {
				t.Error("the verified chain does not start with the agent's certificate")
			}
			if _, err := tlsHandshake(t, n, ca, &foreign, nil); (err == nil) != tc.foreignC {
				t.Errorf("with another CA's certificate: %v", err)
			}
		})
	}
}

// TestClientAuthReloadSwap: the TLS a config's Start stores applies to the
// next handshake: a reload to another CA refuses the first CA's
// certificates and takes the new CA's, a rolled-back start gives the
// previous back, and a session resumed from a ticket of the earlier config
// is checked against the current CA too.
func TestClientAuthReloadSwap(t *testing.T) {
	ca1, ca2 := newTestCA(t, "one", 30*24*time.Hour), newTestCA(t, "two", 30*24*time.Hour)
	cert1, cert2 := ca1.clientCert(t, "urn:a"), ca2.clientCert(t, "urn:a")
	first := serverTLS(t, ca1, &ClientAuth{Require: true})
	n := tlsNode(first)
	sessions := tls.NewLRUClientSessionCache(4)
	if _, err := tlsHandshake(t, n, ca1, &cert1, sessions); err != nil {
		t.Fatalf("CA one's certificate under CA one: %v", err)
	}

	second := &controlTLS{internal: first.internal} // same serving certificate, other client CA
	second.withClientAuth(ca2.signingCA, true)
	n.ctls.Store(second)
	if info, err := tlsHandshake(t, n, ca1, &cert1, sessions); err == nil {
		t.Fatalf("CA one's certificate after the reload to CA two was taken (resumed %v)", info.State.DidResume)
	}
	if _, err := tlsHandshake(t, n, ca1, &cert2, nil); err != nil {
		t.Fatalf("CA two's certificate after the reload: %v", err)
	}

	n.ctls.Store(first) // App.Stop of a rolled-back start
	if _, err := tlsHandshake(t, n, ca1, &cert1, nil); err != nil {
		t.Fatalf("CA one's certificate after the rollback: %v", err)
	}
}

// TestResumedSessionVerifiedAgainstCurrentCA: a session ticket from a
// handshake under one CA does not resume past a reload to another; it
// resumes under the same CA.
func TestResumedSessionVerifiedAgainstCurrentCA(t *testing.T) {
	ca1, ca2 := newTestCA(t, "one", 30*24*time.Hour), newTestCA(t, "two", 30*24*time.Hour)
	cert1 := ca1.clientCert(t, "urn:a")
	first := serverTLS(t, ca1, &ClientAuth{})
	n := tlsNode(first)
	sessions := tls.NewLRUClientSessionCache(4)
	if _, err := tlsHandshake(t, n, ca1, &cert1, sessions); err != nil {
		t.Fatal(err)
	}
	info, err := tlsHandshake(t, n, ca1, &cert1, sessions)
	if err != nil || !info.State.DidResume {
		t.Fatalf("no resumption under the same CA (err %v): the test would prove nothing", err)
	}
	second := &controlTLS{internal: first.internal}
	second.withClientAuth(ca2.signingCA, false)
	n.ctls.Store(second)
	if info, err := tlsHandshake(t, n, ca1, &cert1, sessions); err == nil {
		t.Fatalf("a ticket of CA one's session passed under CA two (resumed %v)", info.State.DidResume)
	}
}

// TestInternalCertRenewsAtTwoThirds: the handshake at two thirds of the
// certificate's lifetime gets a new one; until then the same one.
func TestInternalCertRenewsAtTwoThirds(t *testing.T) {
	ca := newTestCA(t, "renew", 365*24*time.Hour)
	now := time.Now()
	ic := fakeClockInternal(t, ca, 3*time.Hour, &now)
	first, _ := ic.get()
	now = now.Add(2*time.Hour - time.Second)
	if c, _ := ic.get(); c != first {
		t.Fatal("renewed before two thirds")
	}
	now = now.Add(2 * time.Second)
	renewed, err := ic.get()
	if err != nil || renewed == first {
		t.Fatalf("not renewed at two thirds: %v", err)
	}
	if renewed.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 || (renewed.Leaf.NotAfter.Sub(now)-3*time.Hour).Abs() > time.Second {
		t.Errorf("renewed: serial %v (was %v), NotAfter %v", renewed.Leaf.SerialNumber, first.Leaf.SerialNumber, renewed.Leaf.NotAfter)
	}
	if !slices.Equal(renewed.Leaf.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}) {
		t.Errorf("usage %v", renewed.Leaf.ExtKeyUsage)
	}
	if _, err := renewed.Leaf.Verify(x509.VerifyOptions{Roots: ca.pool(), DNSName: "127.0.0.1", CurrentTime: now}); err != nil {
		t.Errorf("the renewed certificate does not verify for 127.0.0.1: %v", err)
	}
}

// fakeClockInternal is a tls_internal certificate for 127.0.0.1 whose
// clock reads *now (set before the handshakes run).
func fakeClockInternal(t *testing.T, ca *testCA, lifetime time.Duration, now *time.Time) *internalCert {
	t.Helper()
	ic, err := (&InternalTLS{Names: []string{"127.0.0.1"}, Lifetime: caddy.Duration(lifetime)}).provision(ca.signingCA, caddy.NetworkAddress{}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	start := *now
	ic.now = func() time.Time { return *now }
	ic.cur.Load().renewAt = start.Add(lifetime * 2 / 3)
	ic.cur.Load().notAfter = start.Add(lifetime)
	return ic
}

// TestInternalCertRenewalIsRaceFree: handshakes that find the certificate
// due at once renew it once; none waits for the renewal while the current
// certificate is valid, and none gets an error.
func TestInternalCertRenewalIsRaceFree(t *testing.T) {
	ca := newTestCA(t, "race", 365*24*time.Hour)
	now := time.Now()
	ic := fakeClockInternal(t, ca, 3*time.Hour, &now)
	first, _ := ic.get()
	loads := ca.loads.Load()
	now = now.Add(2*time.Hour + time.Minute)
	var wg sync.WaitGroup
	got := make([]*tls.Certificate, 64)
	for i := range got {
		wg.Go(func() {
			c, err := ic.get()
			if err != nil {
				t.Error(err)
			}
			got[i] = c
		})
	}
	wg.Wait()
	if n := ca.loads.Load() - loads; n != 1 {
		t.Fatalf("%d renewals, want 1", n)
	}
	renewed, _ := ic.get()
	for _, c := range got {
		if c != first && c != renewed {
			t.Fatal("a handshake got a certificate that is neither the old nor the renewed one")
		}
	}
}

// TestInternalCertRenewalFailure: a renewal that fails serves the current
// certificate while it is valid and tries again a minute later, not at
// every handshake; once the certificate expired, handshakes fail until a
// renewal succeeds.
func TestInternalCertRenewalFailure(t *testing.T) {
	ca := newTestCA(t, "fail", 365*24*time.Hour)
	now := time.Now()
	ic := fakeClockInternal(t, ca, 3*time.Hour, &now)
	first, _ := ic.get()
	ca.fail.Store(true)
	loads := ca.loads.Load()
	now = now.Add(2*time.Hour + time.Minute)
	for range 3 {
		if c, err := ic.get(); c != first || err != nil {
			t.Fatalf("a failed renewal: %v", err)
		}
	}
	if n := ca.loads.Load() - loads; n != 1 {
		t.Fatalf("%d attempts within the retry interval, want 1", n)
	}
	now = now.Add(renewRetry)
	ic.get()
	if n := ca.loads.Load() - loads; n != 2 {
		t.Fatalf("%d attempts after the retry interval, want 2", n)
	}
	now = now.Add(2 * time.Hour)
	if _, err := ic.get(); err == nil {
		t.Fatal("an expired certificate was served")
	}
	ca.fail.Store(false)
	now = now.Add(renewRetry)
	if c, err := ic.get(); err != nil || c == first {
		t.Fatalf("no renewal once the CA works again: %v", err)
	}
}

// TestInternalNames: the default names are loopback's and the listen
// host's when it names one host; configured names are checked.
func TestInternalNames(t *testing.T) {
	loop := []string{"localhost", "127.0.0.1", "::1"}
	for _, tc := range []struct {
		listen string
		want   []string
	}{
		{"127.0.0.1:8001", loop},
		{":8001", loop},
		{"0.0.0.0:8001", loop},
		{"[::]:8001", loop},
		{"10.1.2.3:8001", append(loop, "10.1.2.3")},
		{"[2001:db8::1]:8001", append(loop, "2001:db8::1")},
		{"Tunnel.Example.com:8001", append(loop, "tunnel.example.com")},
		{"unix//run/sluice.sock", loop},
	} {
		na, err := caddy.ParseNetworkAddress(tc.listen)
		if err != nil {
			t.Fatal(err)
		}
		got, err := internalNames(nil, na)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v %v, want %v", tc.listen, got, err, tc.want)
		}
	}
	if got, err := internalNames([]string{"node.test", "*.nodes.test", "::1", "node.test"}, caddy.NetworkAddress{}); err != nil ||
		!slices.Equal(got, []string{"node.test", "*.nodes.test", "::1"}) {
		t.Errorf("configured: %v %v", got, err)
	}
	if _, err := internalNames([]string{"not a name"}, caddy.NetworkAddress{}); err == nil || !strings.Contains(err.Error(), "not a name") {
		t.Errorf("a bad name: %v", err)
	}
	ca := newTestCA(t, "short", time.Hour)
	for _, tc := range []struct {
		lifetime time.Duration
		want     string
	}{{time.Second, "shorter than"}, {2 * time.Hour, "ends after the root"}} {
		_, err := (&InternalTLS{Lifetime: caddy.Duration(tc.lifetime)}).provision(ca.signingCA, caddy.NetworkAddress{}, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("lifetime %v: %v, want %q", tc.lifetime, err, tc.want)
		}
	}
}

// TestControlTLSWithoutCertificate: a TLS node whose current config has
// no TLS (no config that passed Provision stores that) fails the
// handshake rather than panicking.
func TestControlTLSWithoutCertificate(t *testing.T) {
	var c *controlTLS
	if _, err := c.certificate(); err == nil {
		t.Fatal("no error")
	}
}

// TestRefusalReachesTheClient: a client without a certificate that
// writes once its handshake is done, as gRPC does (its preface and
// settings), gets to read the node's "certificate required" alert: the
// node does not close the socket under its writes, which would reset the
// connection and fail them with "broken pipe" first.
func TestRefusalReachesTheClient(t *testing.T) {
	ca := newTestCA(t, "alert", 30*24*time.Hour)
	n := tlsNode(serverTLS(t, ca, &ClientAuth{Require: true}))
	for range 10 {
		server, client := tcpPair(t)
		alerted := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			defer client.Close()
			c := tls.Client(client, &tls.Config{RootCAs: ca.pool(), ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
			if err := c.Handshake(); err != nil {
				done <- err
				return
			}
			select {
			case <-alerted:
			case <-time.After(5 * time.Second):
				done <- errors.New("the server wrote no alert")
				return
			}
			for range 4 {
				if _, err := c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")); err != nil {
					done <- err
					return
				}
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := c.Read(make([]byte, 1))
			done <- err
		}()
		if _, _, err := n.creds.ServerHandshake(&alertSignal{Conn: server, alerted: alerted}); err == nil {
			t.Fatal("the handshake without a certificate passed")
		}
		server.Close() // as gRPC does once ServerHandshake returned
		if err := <-done; err == nil || !strings.Contains(err.Error(), "certificate required") {
			t.Fatalf("the client got %v, want the certificate required alert", err)
		}
	}
}

// alertSignal is a server connection that closes alerted when it writes
// after its handshake flight: the alert (encrypted in TLS 1.3, so not
// told by its record type).
type alertSignal struct {
	net.Conn
	alerted chan struct{}
	writes  int
}

func (c *alertSignal) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if c.writes++; c.writes == 2 {
		close(c.alerted)
	}
	return n, err
}
