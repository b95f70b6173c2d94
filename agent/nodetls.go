package agent

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"sync"

	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// loadClientCert reads the client certificate (cert_file) and its private
// key (key_file). Its errors start with the field at fault, for Validate
// and for the warning of a failed re-read alike. The key is never quoted:
// it is a secret.
func loadClientCert(certFile, keyFile string) (*tls.Certificate, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("cert_file: %w", err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("key_file: %w", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("cert_file: %s with key_file %s: %w", certFile, keyFile, err)
	}
	if pair.Leaf == nil { // filled by X509KeyPair unless GODEBUG says otherwise
		if pair.Leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, fmt.Errorf("cert_file: %s: %w", certFile, err)
		}
	}
	return &pair, nil
}

// clientCert is the agent's client certificate. It is read again before
// each connection attempt (forAttempt), as token_file is, so that a
// certificate renewed on disk is presented on the next reconnect without a
// restart; a session's data lane and direct sockets present the pair of
// its attempt, so that one session never shows the node two identities.
type clientCert struct {
	certFile, keyFile string
	log               *zap.Logger

	mu      sync.Mutex
	last    *tls.Certificate // the pair read last without error
	lastErr string           // the last re-read error logged, to log each once
}

// newClientCert reads cfg's client certificate; nil when cfg has none.
func newClientCert(cfg *Config, log *zap.Logger) (*clientCert, error) {
	if cfg.CertFile == "" {
		return nil, nil
	}
	pair, err := loadClientCert(cfg.CertFile, cfg.KeyFile)
	if err != nil {
		return nil, err
	}
	log.Info("client certificate", certFields(pair)...)
	return &clientCert{certFile: cfg.CertFile, keyFile: cfg.KeyFile, log: log, last: pair}, nil
}

// forAttempt reads the pair again and returns it. When it cannot be read
// (being rewritten, say) it returns the pair read before: a broken renewal
// must not cut an agent off while its old certificate is still good. Each
// new problem is logged once, not at every attempt.
func (c *clientCert) forAttempt() *tls.Certificate {
	pair, err := loadClientCert(c.certFile, c.keyFile)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		if msg := err.Error(); msg != c.lastErr {
			c.lastErr = msg
			c.log.Warn("cannot read the client certificate; using the one read before",
				append([]zap.Field{zap.Error(err)}, certFields(c.last)...)...)
		}
		return c.last
	}
	c.lastErr = ""
	if !bytes.Equal(pair.Certificate[0], c.last.Certificate[0]) {
		c.log.Info("cert_file holds a new certificate; using it", certFields(pair)...)
	}
	c.last = pair
	return pair
}

// certFields describe a client certificate in logs: the serial (hex, as
// the node's revoked_serials take it), subject and expiry.
func certFields(pair *tls.Certificate) []zap.Field {
	leaf := pair.Leaf
	return []zap.Field{
		zap.String("serial", leaf.SerialNumber.Text(16)),
		zap.String("subject", leaf.Subject.String()),
		zap.Time("not_after", leaf.NotAfter),
	}
}

// nodeTLSConfig is the TLS configuration of the agent's connections to the
// node, without the client certificate (attemptCredentials adds it); nil
// for a grpc:// server.
func nodeTLSConfig(cfg *Config) (*tls.Config, error) {
	useTLS, hostport := cfg.ServerAddr()
	if !useTLS {
		return nil, nil
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	tc := &tls.Config{
		ServerName:         host,
		InsecureSkipVerify: cfg.Insecure,
		MinVersion:         tls.VersionTLS12,
	}
	if cfg.CAFile != "" {
		pem, err := os.ReadFile(cfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("ca_file: %s: no PEM certificate found", cfg.CAFile)
		}
		tc.RootCAs = pool
	}
	return tc, nil
}

// attemptCredentials are the transport credentials of one session
// attempt with the server's host: its gRPC connection, its data lane and
// its direct sockets all use them, so they all present the client
// certificate read for the attempt.
func (a *Agent) attemptCredentials() credentials.TransportCredentials {
	return a.attemptCredentialsFor("")
}

// attemptCredentialsFor are attemptCredentials for a node whose
// certificate names serverName ("": the server's host): a member of the
// cluster reached at its own URL. The trust settings (ca_file, insecure)
// and the client certificate are the same for every node.
func (a *Agent) attemptCredentialsFor(serverName string) credentials.TransportCredentials {
	if a.nodeTLS == nil {
		return insecure.NewCredentials()
	}
	tc := a.nodeTLS.Clone()
	if serverName != "" {
		tc.ServerName = serverName
	}
	if a.cert != nil {
		pair := a.cert.forAttempt()
		// GetClientCertificate rather than Certificates: from Certificates
		// crypto/tls sends a certificate only if its issuer is among the
		// CAs the server's request names, so a file without the
		// intermediate would silently send none, and the node's refusal
		// of a certificate says more than its refusal of a missing one.
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return pair, nil }
	}
	return credentials.NewTLS(tc)
}
