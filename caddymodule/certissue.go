package caddymodule

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"regexp"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// DefaultClientCertLifetime is the lifetime of a client certificate issued
// without one: long enough not to be a chore, short enough that a lost key
// does not stay good for years (revoke it sooner with revoked_serials).
const DefaultClientCertLifetime = 30 * 24 * time.Hour

// clockSkew backdates a certificate's NotBefore, so that a peer whose clock
// is a little behind accepts a certificate issued a moment ago.
const clockSkew = time.Minute

// IssueRequest is the body of POST /sluice/certificates: a client
// certificate for an agent of a credential with a client_identity.
type IssueRequest struct {
	// Credential names the credential whose client_identity the
	// certificate carries. Required.
	Credential string `json:"credential"`

	// Name is the certificate's common name and, for `caddy sluice
	// issue-cert`, its files' name: letters, digits, '.', '_' and '-', at
	// most 64. Default: the credential's name.
	Name string `json:"name,omitempty"`

	// Lifetime as a Go duration (or with a "d" unit). Default 720h; it
	// must end before the CA's root does.
	Lifetime string `json:"lifetime,omitempty"`
}

// IssuedCertificate is the answer of POST /sluice/certificates.
type IssuedCertificate struct {
	// Certificate is the leaf in PEM (signed by the CA's root: there is
	// no intermediate to send).
	Certificate string `json:"certificate"`
	// Key is the leaf's ECDSA P-256 key, PKCS#8 in PEM. The node keeps no
	// copy.
	Key string `json:"key"`
	// CA is the root certificate in PEM: the agent's ca_file, which
	// verifies a tls_internal control plane too.
	CA string `json:"ca"`
	// Serial is the serial number as revoked_serials takes it.
	Serial     string `json:"serial"`
	NotAfter   string `json:"not_after"` // RFC 3339
	Identity   string `json:"identity"`
	Credential string `json:"credential"`
}

// badIssue is an issue request that cannot be served as asked (400).
type badIssue struct{ error }

func (e badIssue) Unwrap() error { return e.error }

// issueNamePattern is what a certificate's name may be: it becomes file
// names.
var issueNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// checkIssueName refuses a name that cannot be a common name and a file
// name.
func checkIssueName(name string) error {
	if !issueNamePattern.MatchString(name) {
		return fmt.Errorf("name: %q must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	return nil
}

// issueParams is a checked IssueRequest.
type issueParams struct {
	cred     *credential
	name     string
	lifetime time.Duration
}

// issueClientCertificate issues a client certificate under this config's
// client_auth CA for the request's credential, and logs it (never the key).
func (a *App) issueClientCertificate(req IssueRequest, now time.Time) (*IssuedCertificate, error) {
	if a.ctls == nil || a.ctls.clientCA == nil {
		return nil, badIssue{errors.New("the sluice app has no client_auth: no CA verifies agents' certificates")}
	}
	p, err := checkIssueRequest(a.creds, req)
	if err != nil {
		return nil, err
	}
	out, err := issueClientCert(a.ctls.clientCA, p, now)
	if err != nil {
		return nil, err
	}
	a.logger.Info("sluice: issued a client certificate", zap.String("credential", out.Credential),
		zap.String("name", p.name), zap.String("identity", out.Identity),
		zap.String("serial", out.Serial), zap.String("not_after", out.NotAfter), zap.String("ca", a.ctls.clientCA.id))
	return out, nil
}

// checkIssueRequest finds the request's credential in creds and checks
// its name and lifetime.
func checkIssueRequest(creds *credentialSet, req IssueRequest) (issueParams, error) {
	var p issueParams
	if req.Credential == "" {
		return p, badIssue{errors.New("credential: required")}
	}
	if creds != nil {
		p.cred = creds.byName[req.Credential]
	}
	if p.cred == nil {
		return p, badIssue{fmt.Errorf("credential: no credential named %q in the running config", req.Credential)}
	}
	if p.cred.identity == "" {
		return p, badIssue{fmt.Errorf("credential %q has no client_identity: a certificate would authenticate as nothing", req.Credential)}
	}
	p.name = req.Name
	if p.name == "" {
		p.name = req.Credential
	}
	if err := checkIssueName(p.name); err != nil {
		return p, badIssue{err}
	}
	p.lifetime = DefaultClientCertLifetime
	if req.Lifetime != "" {
		d, err := caddy.ParseDuration(req.Lifetime)
		if err != nil {
			return p, badIssue{fmt.Errorf("lifetime: %w", err)}
		}
		if d <= 0 {
			return p, badIssue{fmt.Errorf("lifetime: %q must be positive", req.Lifetime)}
		}
		p.lifetime = d
	}
	return p, nil
}

// issueClientCert signs a client certificate for p under ca: a fresh
// P-256 key, the credential's identity as its URI SAN (when it has a
// scheme) or DNS SAN, the name as its common name, client auth usage.
func issueClientCert(ca *signingCA, p issueParams, now time.Time) (*IssuedCertificate, error) {
	spec := leafSpec{commonName: p.name, usage: x509.ExtKeyUsageClientAuth, lifetime: p.lifetime}
	spec.uris, spec.dnsNames = identitySAN(p.cred.identity)
	// The tap reads identities with certIdentities: refuse one that would
	// not read back as configured (a URI scheme in upper case, a DNS name
	// with capitals), rather than issue a certificate that never matches.
	probe := &x509.Certificate{URIs: spec.uris, DNSNames: spec.dnsNames}
	if !slices.Contains(certIdentities(probe), p.cred.identity) {
		return nil, badIssue{fmt.Errorf("credential %q: client_identity %q does not read back from a certificate as written "+
			"(URIs: lower-case scheme; DNS names: lower case)", p.cred.name, p.cred.identity)}
	}
	leaf, key, err := ca.sign(spec, now)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encoding the key: %w", err)
	}
	return &IssuedCertificate{
		Certificate: pemString("CERTIFICATE", leaf.Raw),
		Key:         pemString("PRIVATE KEY", keyDER),
		CA:          pemString("CERTIFICATE", ca.root.Raw),
		Serial:      SerialHex(leaf.SerialNumber),
		NotAfter:    leaf.NotAfter.UTC().Format(time.RFC3339),
		Identity:    p.cred.identity,
		Credential:  p.cred.name,
	}, nil
}

// identitySAN is where a client identity goes in a certificate: a URI SAN
// when it parses as a URI with a scheme, else a DNS SAN.
func identitySAN(identity string) ([]*url.URL, []string) {
	if u, err := url.Parse(identity); err == nil && u.Scheme != "" {
		return []*url.URL{u}, nil
	}
	return nil, []string{identity}
}

func pemString(typ string, der []byte) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}))
}

// leafSpec is what a certificate signed by a signingCA says.
type leafSpec struct {
	commonName string
	dnsNames   []string
	ips        []net.IP
	uris       []*url.URL
	usage      x509.ExtKeyUsage
	lifetime   time.Duration
}

// errPastRoot is a lifetime that would end after the CA's root.
var errPastRoot = errors.New("the certificate would outlive the CA's root")

// sign makes a P-256 key and a leaf for it per spec, valid from now,
// signed with the CA's root key (see signingCA for why the root).
func (ca *signingCA) sign(spec leafSpec, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	notAfter := now.Add(spec.lifetime)
	if notAfter.After(ca.root.NotAfter) {
		return nil, nil, badIssue{fmt.Errorf("lifetime: %v from now ends after the root of CA %q (%s): %w",
			spec.lifetime, ca.id, ca.root.NotAfter.UTC().Format(time.RFC3339), errPastRoot)}
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generating a key: %w", err)
	}
	notBefore := now.Add(-clockSkew)
	if notBefore.Before(ca.root.NotBefore) {
		notBefore = ca.root.NotBefore
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: spec.commonName},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{spec.usage},
		BasicConstraintsValid: true,
		DNSNames:              spec.dnsNames,
		IPAddresses:           spec.ips,
		URIs:                  spec.uris,
	}
	signer, err := ca.rootKey()
	if err != nil {
		return nil, nil, fmt.Errorf("loading the root key of CA %q: %w", ca.id, err)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.root, &key.PublicKey, signer)
	if err != nil {
		return nil, nil, fmt.Errorf("signing with CA %q: %w", ca.id, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parsing the signed certificate: %w", err)
	}
	return leaf, key, nil
}

// randomSerial is a random, positive 128-bit serial number: unique
// without a record of those issued, and unguessable.
func randomSerial() (*big.Int, error) {
	b := make([]byte, 16)
	for {
		if _, err := rand.Read(b); err != nil {
			return nil, fmt.Errorf("serial number: %w", err)
		}
		if n := new(big.Int).SetBytes(b); n.Sign() > 0 {
			return n, nil
		}
	}
}
