package caddymodule

import (
	"cmp"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"os"
	"slices"
	"strings"

	"google.golang.org/grpc/credentials"

	"github.com/caddyserver/caddy/v2/modules/caddypki"
	"github.com/sluice-tunnel/sluice/internal/hostname"
	"github.com/sluice-tunnel/sluice/internal/ident"
)

// Credential is one named agent credential: a token, a client-certificate
// identity, or both, and the scope of what the agents presenting it may
// serve. An agent's id is its own within its credential: an agent of one
// credential never displaces an agent of another with the same id.
type Credential struct {
	// Name names the credential in logs, metrics, AdvertiseAck and the
	// status API. Required, unique, printable ASCII without spaces.
	Name string `json:"name"`

	// Token is a bearer token that authenticates as this credential.
	// Mutually exclusive with TokenFile; every credential's token must
	// differ from the others' and from the node's unscoped token.
	Token string `json:"token,omitempty"`

	// TokenFile is a file holding the token, read at each config load.
	TokenFile string `json:"token_file,omitempty"`

	// ClientIdentity is the identity of the client certificates (signed by
	// the client_auth CA) that authenticate as this credential: a URI SAN
	// when it has a scheme ("spiffe://example.com/team-a",
	// "urn:sluice:team-a"), else a DNS SAN. `caddy sluice issue-cert`
	// issues certificates that carry it.
	ClientIdentity string `json:"client_identity,omitempty"`

	// Scope is what the credential's agents may advertise. Unset fields
	// allow nothing of their kind.
	Scope Scope `json:"scope,omitempty"`
}

// Scope bounds the routes a credential's agents may advertise. A route
// outside it is rejected in AdvertiseAck with reason `out_of_scope`; the
// agent's other routes stay up.
type Scope struct {
	// Hosts are the HTTP hosts the agents may serve (routes with a host,
	// http, https or tcp target): exact names, or "*.example.com" for
	// every name under example.com, at any depth (not example.com
	// itself). "*" allows every host. The hosts a pattern route of the
	// credential matches are also limited to these.
	Hosts []string `json:"hosts,omitempty"`

	// ServerNames are the TLS server names of passthrough routes, in the
	// same form as Hosts; they also limit what a passthrough pattern
	// matches.
	ServerNames []string `json:"server_names,omitempty"`

	// Services are the names of the named TCP services (layer4's `sluice
	// NAME`) the agents may serve; "*" allows any.
	Services []string `json:"services,omitempty"`

	// Ports is the list of listen ports the agents may claim, within the
	// node's tcp_port_range (or udp_port_range), in its syntax: ports and
	// lo-hi ranges, comma-separated ("16000-16099,17000").
	Ports string `json:"ports,omitempty"`

	// AllowPatterns lets the agents advertise host patterns (HTTP and TLS
	// passthrough), each limited to the Hosts or ServerNames above.
	AllowPatterns bool `json:"allow_patterns,omitempty"`

	// AllowCatchAll lets the agents advertise the catch-all route, which
	// takes the requests for every host no other route serves.
	AllowCatchAll bool `json:"allow_catch_all,omitempty"`

	// MaxSessions bounds the sessions of the credential's agents on the
	// node. 0: only the node's max_sessions.
	MaxSessions int `json:"max_sessions,omitempty"`
}

// ClientAuth has the control plane verify agents' client certificates
// against a CA of Caddy's `pki` app. It needs TLS on the control plane
// (tls or tls_internal).
type ClientAuth struct {
	// CA is the id of the pki app's certificate authority that signs
	// agents' certificates. Default "local", the CA of `tls internal`.
	CA string `json:"ca,omitempty"`

	// Require refuses agent connections without a valid client
	// certificate at the TLS handshake; tokens alone no longer get in.
	// Without it a certificate is verified when one is presented.
	Require bool `json:"require,omitempty"`

	// RevokedSerials are serial numbers (hex, colons allowed, as `openssl
	// x509 -serial` and the issue API print them) of client certificates
	// refused from now on. A reload that adds one ends the sessions that
	// authenticated with that certificate.
	RevokedSerials []string `json:"revoked_serials,omitempty"`
}

// credential is a Credential made ready for the tap and for admission.
// The node's unscoped token is the credential named "" with scope nil.
type credential struct {
	name     string
	tokenSum [32]byte // SHA-256 of the token; zero: no token
	identity string   // ClientIdentity
	scope    *scope   // nil: unscoped (every route)
	// source is the config's Credential, compared on reload to decide
	// whether a session's routes must be admitted again.
	source *Credential
}

// credentialSet is the node's credentials under the current config; each
// Start stores a new one (node.creds).
type credentialSet struct {
	byToken    map[[32]byte]*credential
	byIdentity map[string]*credential
	byName     map[string]*credential
	revoked    map[string]bool // normalised serials (serialKey)
	// clientCerts: connections may carry client certificates (client_auth
	// is set); without it a certificate is never an identity. requireCert:
	// client_auth's require, so only a certificate's credential gets in.
	// caID names the CA that verifies them.
	clientCerts, requireCert bool
	caID                     string
}

// authn is how a stream authenticated: its credential, and the secret it
// presented (a token's digest, or a certificate's serial).
type authn struct {
	cred     *credential
	tokenSum [32]byte
	serial   string // the client certificate's (serialKey); "": a token
	ca       string // the id of the CA that verified the certificate
}

// credentialName is the credential's name for logs ("" reads as "token").
func (c *credential) displayName() string {
	if c.name == "" {
		return "(token)"
	}
	return c.name
}

// errCredentialChanged ends the sessions whose credential a reload removed,
// whose token it changed, or whose certificate it revoked.
var errCredentialChanged = errors.New("the node's credentials changed; reconnect with a current one")

// stillValid reports whether a stream that authenticated as au would
// authenticate the same way under s: its credential is still there, with
// the same token, or the same client identity and its certificate not
// revoked.
func (s *credentialSet) stillValid(au authn) bool {
	if au.cred == nil {
		return false
	}
	cur := s.byName[au.cred.name]
	switch {
	case cur == nil:
		return false
	case au.serial != "" && (!s.clientCerts || au.ca != s.caID || cur.identity != au.cred.identity || s.revoked[au.serial]):
		return false
	case au.serial == "" && s.requireCert:
		return false // require turned on: tokens alone no longer get in
	case au.tokenSum != [32]byte{} && cur.tokenSum != au.tokenSum:
		return false
	}
	return true
}

// buildCredentials makes the node's credential set from the unscoped token
// ("" for none) and the named credentials, reading token files. Errors
// name the field.
func buildCredentials(token string, creds []*Credential, auth *ClientAuth) (*credentialSet, error) {
	s := &credentialSet{byToken: map[[32]byte]*credential{}, byIdentity: map[string]*credential{},
		byName: map[string]*credential{}, revoked: map[string]bool{}, clientCerts: auth != nil}
	if auth != nil {
		s.requireCert, s.caID = auth.Require, cmp.Or(auth.CA, caddypki.DefaultCAID)
	}
	if token != "" {
		c := &credential{tokenSum: sha256.Sum256([]byte(token))}
		s.byToken[c.tokenSum], s.byName[""] = c, c
	}
	for i, src := range creds {
		c, err := compileCredential(src)
		if err != nil {
			return nil, fmt.Errorf("sluice: credentials[%d]: %w", i, err)
		}
		if s.byName[c.name] != nil {
			return nil, fmt.Errorf("sluice: credentials[%d]: name %q is used twice", i, c.name)
		}
		if c.tokenSum != ([32]byte{}) {
			if other := s.byToken[c.tokenSum]; other != nil {
				return nil, fmt.Errorf("sluice: credential %q: its token is also %s's; every credential needs its own", c.name, other.displayName())
			}
			s.byToken[c.tokenSum] = c
		}
		if c.identity != "" {
			if auth == nil {
				return nil, fmt.Errorf("sluice: credential %q: client_identity needs client_auth (the CA that signs agents' certificates)", c.name)
			}
			if other := s.byIdentity[c.identity]; other != nil {
				return nil, fmt.Errorf("sluice: credential %q: client_identity %q is also %s's", c.name, c.identity, other.name)
			}
			s.byIdentity[c.identity] = c
		}
		s.byName[c.name] = c
	}
	if auth != nil {
		for _, sn := range auth.RevokedSerials {
			k, err := serialKeyOf(sn)
			if err != nil {
				return nil, fmt.Errorf("sluice: client_auth: revoked_serials: %w", err)
			}
			s.revoked[k] = true
		}
	}
	return s, nil
}

// compileCredential checks one configured credential and compiles its scope.
func compileCredential(src *Credential) (*credential, error) {
	if src == nil {
		return nil, errors.New("empty")
	}
	if src.Name == "" {
		return nil, errors.New("name: required")
	}
	if err := ident.CheckID(src.Name); err != nil {
		return nil, fmt.Errorf("name: %w", err)
	}
	c := &credential{name: src.Name, identity: src.ClientIdentity, source: src}
	token, err := credentialToken(src)
	if err != nil {
		return nil, fmt.Errorf("credential %q: %w", src.Name, err)
	}
	if token != "" {
		c.tokenSum = sha256.Sum256([]byte(token))
	}
	if token == "" && src.ClientIdentity == "" {
		return nil, fmt.Errorf("credential %q: needs token, token_file or client_identity", src.Name)
	}
	if c.scope, err = compileScope(src.Scope); err != nil {
		return nil, fmt.Errorf("credential %q: scope: %w", src.Name, err)
	}
	return c, nil
}

// credentialToken reads a credential's token or token file.
func credentialToken(src *Credential) (string, error) {
	switch {
	case src.Token != "" && src.TokenFile != "":
		return "", errors.New("token and token_file are mutually exclusive")
	case src.Token != "":
		t := ident.TrimToken(src.Token)
		if err := ident.CheckToken(t); err != nil {
			return "", fmt.Errorf("token: %w", err)
		}
		return t, nil
	case src.TokenFile != "":
		b, err := os.ReadFile(src.TokenFile)
		if err != nil {
			return "", fmt.Errorf("token_file: %w", err)
		}
		t := ident.TrimToken(string(b))
		if t == "" {
			return "", fmt.Errorf("token_file: %s is empty", src.TokenFile)
		}
		if err := ident.CheckToken(t); err != nil {
			return "", fmt.Errorf("token_file: %s: %w", src.TokenFile, err)
		}
		return t, nil
	}
	return "", nil
}

// serialKeyOf normalises a certificate serial written in hex, with or
// without colons or a 0x prefix, to lower-case hex without leading zeros.
func serialKeyOf(s string) (string, error) {
	h := strings.ToLower(strings.ReplaceAll(strings.TrimSpace(s), ":", ""))
	h = strings.TrimPrefix(h, "0x")
	b, ok := new(big.Int).SetString(h, 16)
	if h == "" || !ok || b.Sign() < 0 {
		return "", fmt.Errorf("%q is not a hexadecimal serial number", s)
	}
	return b.Text(16), nil
}

// serialKey is a certificate's serial as serialKeyOf writes it.
func serialKey(cert *x509.Certificate) string { return cert.SerialNumber.Text(16) }

// SerialHex writes a serial number as the issue API and the revoked_serials
// option do: lower-case hex pairs joined by colons.
func SerialHex(n *big.Int) string {
	b := n.Bytes()
	parts := make([]string, len(b))
	for i, x := range b {
		parts[i] = hex.EncodeToString([]byte{x})
	}
	if len(parts) == 0 {
		return "00"
	}
	return strings.Join(parts, ":")
}

// scope is a compiled Scope.
type scope struct {
	hosts, serverNames nameSet
	services           map[string]bool
	anyService         bool
	ports              portRange
	patterns, catchAll bool
	maxSessions        int
}

// compileScope checks and compiles a Scope.
func compileScope(s Scope) (*scope, error) {
	c := &scope{patterns: s.AllowPatterns, catchAll: s.AllowCatchAll, maxSessions: s.MaxSessions, services: map[string]bool{}}
	var err error
	if c.hosts, err = compileNameSet(s.Hosts); err != nil {
		return nil, fmt.Errorf("hosts: %w", err)
	}
	if c.serverNames, err = compileNameSet(s.ServerNames); err != nil {
		return nil, fmt.Errorf("server_names: %w", err)
	}
	for _, name := range s.Services {
		if name == "*" {
			c.anyService = true
			continue
		}
		if name == "" || len(name) > maxRouteNameLength {
			return nil, fmt.Errorf("services: %q is not a route name", name)
		}
		c.services[name] = true
	}
	if c.ports, err = parsePortRange(s.Ports); err != nil {
		return nil, fmt.Errorf("ports: %w", err)
	}
	if s.MaxSessions < 0 {
		return nil, errors.New("max_sessions: must not be negative")
	}
	return c, nil
}

// nameSet is a list of host names: exact ones, "*.suffix" wildcards and
// "*" for all.
type nameSet struct {
	all      bool
	exact    map[string]bool
	suffixes []string // ".example.com"
}

// compileNameSet checks and compiles names.
func compileNameSet(names []string) (nameSet, error) {
	s := nameSet{exact: map[string]bool{}}
	for _, raw := range names {
		n := strings.TrimSuffix(strings.ToLower(raw), ".")
		switch {
		case n == "*":
			s.all = true
		case strings.HasPrefix(n, "*."):
			if !hostname.Valid(n[2:]) {
				return s, fmt.Errorf("%q: a wildcard is *. followed by a host name", raw)
			}
			s.suffixes = append(s.suffixes, n[1:])
		case strings.Contains(n, "*"):
			return s, fmt.Errorf("%q: a wildcard is only allowed as a whole first label (*.example.com)", raw)
		case !hostname.ValidRoute(n):
			return s, fmt.Errorf("%q is not a host name or IP address", raw)
		default:
			s.exact[n] = true
		}
	}
	return s, nil
}

// contains reports whether host (lower case, no trailing dot) is in s.
func (s *nameSet) contains(host string) bool {
	if s.all || s.exact[host] {
		return true
	}
	for _, suf := range s.suffixes {
		if len(host) > len(suf) && strings.HasSuffix(host, suf) {
			return true
		}
	}
	return false
}

// empty reports whether s allows no name.
func (s *nameSet) empty() bool { return !s.all && len(s.exact) == 0 && len(s.suffixes) == 0 }

// tlsInfoOf returns the TLS state of a connection's AuthInfo, looking
// through the node's wrappers; nil for a plaintext connection.
func tlsInfoOf(ai credentials.AuthInfo) *credentials.TLSInfo {
	for range 8 {
		switch a := ai.(type) {
		case credentials.TLSInfo:
			return &a
		case interface{ Unwrap() credentials.AuthInfo }:
			ai = a.Unwrap()
		default:
			return nil
		}
	}
	return nil
}

// isURIIdentity reports whether a client identity is a URI (it has a
// scheme) rather than a DNS name, which never holds a colon.
func isURIIdentity(id string) bool { return strings.Contains(id, ":") }

// certIdentities returns the identities a verified client certificate
// carries: its URI SANs, then its DNS SANs.
func certIdentities(cert *x509.Certificate) []string {
	out := make([]string, 0, len(cert.URIs)+len(cert.DNSNames))
	for _, u := range cert.URIs {
		out = append(out, u.String())
	}
	for _, d := range cert.DNSNames {
		out = append(out, strings.ToLower(d))
	}
	return slices.Compact(out)
}

// provisionCredentials builds the credential set of the config: the
// unscoped token (a.token, "" for none) and the named credentials.
func (a *App) provisionCredentials() error {
	set, err := buildCredentials(a.token, a.Credentials, a.ClientAuth)
	if err != nil {
		return err
	}
	if len(set.byName) == 0 {
		return errors.New("sluice: no credential: set token, token_file or credentials")
	}
	a.creds = set
	return nil
}
