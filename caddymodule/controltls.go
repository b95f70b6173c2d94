package caddymodule

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddypki"
	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"

	"github.com/sluice-tunnel/sluice/internal/hostname"
)

// InternalTLS serves the control plane with a certificate its node issues
// itself from a CA of Caddy's pki app.
type InternalTLS struct {
	// Names are the DNS names and IP addresses the certificate covers,
	// those agents dial. Default: localhost, 127.0.0.1 and ::1, and the
	// host of listen when it names one.
	Names []string `json:"names,omitempty"`

	// Lifetime of each certificate; the node renews it at two thirds.
	// Default 7 days.
	Lifetime caddy.Duration `json:"lifetime,omitempty"`
}

// Defaults of tls_internal and of client certificates.
const (
	// DefaultInternalLifetime is the lifetime of a tls_internal
	// certificate: short, since the node renews it by itself.
	DefaultInternalLifetime = 7 * 24 * time.Hour
	// minInternalLifetime keeps a tls_internal certificate from being
	// renewed on nearly every handshake.
	minInternalLifetime = time.Minute
	// renewRetry is how long a failed renewal of a still valid
	// tls_internal certificate waits before the next handshake tries
	// again: the CA's root key is read from storage for each attempt.
	renewRetry = time.Minute
)

// controlTLS is one config's TLS for the control plane: the certificate it
// serves and how it verifies agents' client certificates. The node reads
// the current config's (node.ctls) at each handshake, so a reload changes
// both for new connections without a new listener.
type controlTLS struct {
	cert     *tls.Certificate // tls_cert_file; nil with tls_internal
	internal *internalCert    // tls_internal
	// clientCA is the client_auth CA; nil: no client certificate is
	// asked for. clientConfig is the handshake's config with it.
	clientCA     *signingCA
	clientConfig *tls.Config
}

// certificate returns the certificate to serve.
func (c *controlTLS) certificate() (*tls.Certificate, error) {
	switch {
	case c == nil:
		return nil, errors.New("sluice: the control plane has no certificate")
	case c.internal != nil:
		return c.internal.get()
	}
	return c.cert, nil
}

// withClientAuth sets up the verification of agents' client certificates
// against ca's root (see signingCA for why the root). The config it makes
// is what GetConfigForClient hands each handshake. A session resumed from
// a ticket of an earlier config is checked against this pool too: Go's
// server verifies a ticket's chains against the current ClientCAs.
func (c *controlTLS) withClientAuth(ca *signingCA, require bool) {
	pool := x509.NewCertPool()
	pool.AddCert(ca.root)
	mode := tls.VerifyClientCertIfGiven
	if require {
		mode = tls.RequireAndVerifyClientCert
	}
	c.clientCA = ca
	c.clientConfig = &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2"},
		ClientAuth: mode,
		ClientCAs:  pool,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return c.certificate()
		},
	}
}

// tlsCreds are the control plane's TLS transport credentials (see
// tlsConfig and alertingCreds).
func (n *node) tlsCreds() credentials.TransportCredentials {
	return alertingCreds{credentials.NewTLS(n.tlsConfig())}
}

// tlsConfig is the control plane's TLS config: every handshake reads the
// current config's controlTLS, so a reload renews the certificate and
// changes client verification without a new listener. Data lanes and
// direct sockets handshake through it too, so agents present their client
// certificate there as well.
func (n *node) tlsConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return n.ctls.Load().certificate()
		},
		// nil without client_auth: this config, asking for no certificate.
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			if c := n.ctls.Load(); c != nil && c.clientConfig != nil {
				return c.clientConfig, nil
			}
			return nil, nil
		},
	}
}

// refusalLinger bounds how long a connection whose TLS handshake failed
// is read (and discarded) before it is closed.
const refusalLinger = time.Second

// alertingCreds are TLS transport credentials whose refusals reach the
// client. With TLS 1.3 the server verifies a client certificate after the
// client's last handshake flight, and the client writes its first bytes
// (gRPC's preface) without waiting for the verdict. A socket closed at
// once answers them with a reset, and the client's write fails with
// "broken pipe" before it reads the alert that says why ("certificate
// required", "unknown certificate authority"). So a failed handshake
// keeps the socket open, reading and discarding what the client sends
// until it closes (it does on the alert), for at most refusalLinger; then
// gRPC closes it.
type alertingCreds struct {
	credentials.TransportCredentials
}

// ServerHandshake implements credentials.TransportCredentials.
func (c alertingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	hc := &handshakeConn{Conn: raw}
	conn, ai, err := c.TransportCredentials.ServerHandshake(hc)
	if err != nil {
		raw.SetReadDeadline(time.Now().Add(refusalLinger))
		io.Copy(io.Discard, io.LimitReader(raw, 64<<10))
		return nil, nil, err // the caller closes raw
	}
	hc.handshook.Store(true)
	return conn, ai, nil
}

// Clone implements credentials.TransportCredentials.
func (c alertingCreds) Clone() credentials.TransportCredentials {
	return alertingCreds{c.TransportCredentials.Clone()}
}

// handshakeConn is a connection under a TLS handshake: until it succeeded,
// Close leaves the socket open (alertingCreds.ServerHandshake drains it).
type handshakeConn struct {
	net.Conn
	handshook atomic.Bool
}

// Close implements net.Conn.
func (c *handshakeConn) Close() error {
	if !c.handshook.Load() {
		return nil
	}
	return c.Conn.Close()
}

// NetConn returns the connection under the handshake.
func (c *handshakeConn) NetConn() net.Conn { return c.Conn }

// signingCA is a pki app CA as the control plane uses it: its root
// certificate, and its root key read from storage when a certificate is
// signed (Caddy keeps the root key out of memory).
//
// Certificates are signed with the root, not the intermediate: Caddy's
// intermediate lives 7 days (caddypki's default intermediate_lifetime)
// and is replaced once a fifth of that is left, and a leaf must not
// outlive the chain that verifies it. Client certificates live 30 days by
// default, and must keep verifying while the intermediate that would have
// signed them rotates; the root is never rotated by Caddy (10 years). So
// the client CA pool, the `ca` bundle the issue API returns and what
// agents trust for a tls_internal control plane are all the root alone,
// and issued chains are just the leaf.
type signingCA struct {
	id      string
	root    *x509.Certificate
	rootKey func() (crypto.Signer, error)
}

// pkiCA returns the pki app's CA id ("" for "local", which the pki app
// provisions even when the config does not configure it).
func pkiCA(ctx caddy.Context, id string) (*signingCA, error) {
	if id == "" {
		id = caddypki.DefaultCAID
	}
	app, err := ctx.App("pki")
	if err != nil {
		return nil, err
	}
	pki, ok := app.(*caddypki.PKI)
	if !ok {
		return nil, fmt.Errorf("the pki app is a %T", app)
	}
	ca, err := pki.GetCA(ctx, id)
	if err != nil {
		return nil, err
	}
	root := ca.RootCertificate()
	if root == nil {
		return nil, fmt.Errorf("CA %q has no root certificate", id)
	}
	return &signingCA{id: id, root: root, rootKey: ca.RootKey}, nil
}

// loadControlTLS makes this config's control-plane TLS from tls_cert_file,
// tls_internal and client_auth: nil for plaintext. na is the listen
// address (tls_internal's default names).
func (a *App) loadControlTLS(ctx caddy.Context, na caddy.NetworkAddress) (*controlTLS, error) {
	if a.TLSInternal != nil && (a.TLSCertFile != "" || a.TLSKeyFile != "") {
		return nil, errors.New("sluice: tls_internal and tls_cert_file/tls_key_file are mutually exclusive: " +
			"the control plane serves one certificate")
	}
	cert, err := a.loadCertificate()
	if err != nil {
		return nil, err
	}
	if cert == nil && a.TLSInternal == nil {
		if a.ClientAuth != nil {
			return nil, errors.New("sluice: client_auth needs TLS on the control plane: " +
				"set tls_internal, or tls_cert_file and tls_key_file")
		}
		return nil, nil
	}
	c := &controlTLS{cert: cert}
	var ca *signingCA
	if a.ClientAuth != nil {
		if ca, err = pkiCA(ctx, a.ClientAuth.CA); err != nil {
			return nil, fmt.Errorf("sluice: client_auth: ca %q: %w", a.ClientAuth.CA, err)
		}
		c.withClientAuth(ca, a.ClientAuth.Require)
	}
	if a.TLSInternal != nil {
		if ca == nil {
			if ca, err = pkiCA(ctx, caddypki.DefaultCAID); err != nil {
				return nil, fmt.Errorf("sluice: tls_internal: CA %q: %w", caddypki.DefaultCAID, err)
			}
		}
		if c.internal, err = a.TLSInternal.provision(ca, na, a.logger); err != nil {
			return nil, fmt.Errorf("sluice: tls_internal: %w", err)
		}
	}
	return c, nil
}

// provision checks t and issues its first certificate, so a CA that cannot
// sign fails the load rather than agents' handshakes.
func (t *InternalTLS) provision(ca *signingCA, na caddy.NetworkAddress, logger *zap.Logger) (*internalCert, error) {
	lifetime := time.Duration(t.Lifetime)
	switch {
	case lifetime == 0:
		lifetime = DefaultInternalLifetime
	case lifetime < minInternalLifetime:
		return nil, fmt.Errorf("lifetime: %v is shorter than %v", lifetime, minInternalLifetime)
	}
	names, err := internalNames(t.Names, na)
	if err != nil {
		return nil, fmt.Errorf("names: %w", err)
	}
	ic := &internalCert{ca: ca, names: names, lifetime: lifetime, logger: logger, now: time.Now}
	if ic.logger == nil {
		ic.logger = zap.NewNop()
	}
	first, err := ic.issue(ic.now())
	if err != nil {
		return nil, err
	}
	ic.cur.Store(first)
	return ic, nil
}

// internalNames are the names of a tls_internal certificate: those
// configured, else localhost, the loopback addresses and the listen host
// when it names one host (not a wildcard address or a socket).
func internalNames(configured []string, na caddy.NetworkAddress) ([]string, error) {
	names := configured
	if len(names) == 0 {
		names = []string{"localhost", "127.0.0.1", "::1"}
		if h := na.Host; h != "" && !na.IsUnixNetwork() && !na.IsFdNetwork() {
			if ip, err := netip.ParseAddr(h); err != nil || !ip.IsUnspecified() {
				names = append(names, h)
			}
		}
	}
	out := make([]string, 0, len(names))
	for _, n := range names {
		n = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(n)), ".")
		if ip, err := netip.ParseAddr(n); err == nil {
			n = ip.String()
		} else if !hostname.Valid(strings.TrimPrefix(n, "*.")) {
			return nil, fmt.Errorf("%q is not a host name or IP address", n)
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, nil
}

// internalCert is a tls_internal certificate and its renewal. The
// handshake that finds it at two thirds of its lifetime renews it while
// the others go on serving the current one; no goroutine is needed.
type internalCert struct {
	ca       *signingCA
	names    []string
	lifetime time.Duration
	logger   *zap.Logger
	now      func() time.Time

	cur atomic.Pointer[servedCert]
	// mu is held by the handshake that renews; retryAt and lastErr are
	// under it.
	mu      sync.Mutex
	retryAt time.Time
	lastErr error
}

// servedCert is an issued control-plane certificate and when to renew it.
type servedCert struct {
	cert              *tls.Certificate
	renewAt, notAfter time.Time
}

// get returns the certificate to serve, renewing it first when it is due.
// Handshakes that find a renewal under way serve the current certificate
// while it is valid, and wait for the renewal once it expired.
func (ic *internalCert) get() (*tls.Certificate, error) {
	now := ic.now()
	cur := ic.cur.Load()
	if now.Before(cur.renewAt) {
		return cur.cert, nil
	}
	valid := now.Before(cur.notAfter)
	if !valid {
		ic.mu.Lock()
	} else if !ic.mu.TryLock() {
		return cur.cert, nil // another handshake renews it
	}
	defer ic.mu.Unlock()
	if latest := ic.cur.Load(); latest != cur {
		return latest.cert, nil // renewed while this handshake waited
	}
	if now.Before(ic.retryAt) {
		if valid {
			return cur.cert, nil
		}
		return nil, ic.lastErr
	}
	next, err := ic.issue(now)
	if err != nil {
		ic.retryAt, ic.lastErr = now.Add(renewRetry), err
		ic.logger.Error("sluice: renewing the tls_internal certificate failed",
			zap.Bool("current_still_valid", valid), zap.Time("current_not_after", cur.notAfter), zap.Error(err))
		if valid {
			return cur.cert, nil
		}
		return nil, err
	}
	ic.cur.Store(next)
	ic.logger.Info("sluice: renewed the tls_internal certificate",
		zap.Strings("names", ic.names), zap.Time("not_after", next.notAfter))
	return next.cert, nil
}

// issue signs a new control-plane certificate, valid from now.
func (ic *internalCert) issue(now time.Time) (*servedCert, error) {
	spec := leafSpec{commonName: ic.names[0], usage: x509.ExtKeyUsageServerAuth, lifetime: ic.lifetime}
	for _, n := range ic.names {
		if ip := net.ParseIP(n); ip != nil {
			spec.ips = append(spec.ips, ip)
		} else {
			spec.dnsNames = append(spec.dnsNames, n)
		}
	}
	leaf, key, err := ic.ca.sign(spec, now)
	if err != nil {
		return nil, err
	}
	cert := &tls.Certificate{Certificate: [][]byte{leaf.Raw}, PrivateKey: key, Leaf: leaf}
	return &servedCert{cert: cert, renewAt: now.Add(ic.lifetime * 2 / 3), notAfter: leaf.NotAfter}, nil
}

// Interface guards
var (
	_ credentials.TransportCredentials = alertingCreds{}
	_ net.Conn                         = (*handshakeConn)(nil)
)
