package caddymodule

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"reflect"
	"slices"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// Authentication happens in gRPC's tap (grpc.InTapHandle), which runs on
// a new stream's headers before the stream is handed to a handler and
// before any of its messages is read: a stream without a valid credential
// is refused at its headers, so what an unauthenticated client can make
// the node buffer is one header block (MaxHeaderListSize), not a message
// (gRPC reads and buffers a unary request whole before its handler runs).

// maxAuthFailuresPerConn is how many streams with a wrong or missing
// credential a control connection may open before the node closes it:
// enough for an agent to read why it was refused, too few to guess.
const maxAuthFailuresPerConn = 3

// errUnauthenticated is every credential refusal, whatever was wrong, so
// a guesser learns nothing from the answer.
var errUnauthenticated = status.Error(codes.Unauthenticated, "invalid or missing credential")

// authnKey is the context key of how a stream authenticated (authn).
type authnKey struct{}

// tapAuthenticate is the gRPC server's InTapHandle: it finds the
// credential of a stream (identify). One found proves the connection (it
// leaves the guard's pending pool) and rides on the stream's context to
// its handler (authenticated); none is counted, logged through a throttle,
// and closes the connection at its maxAuthFailuresPerConn-th.
func (n *node) tapAuthenticate(ctx context.Context, info *tap.Info) (context.Context, error) {
	au, ok := n.identify(ctx, info.Header)
	conn := guardedConnOf(ctx)
	if !ok {
		n.authFailed(ctx, conn)
		return nil, errUnauthenticated
	}
	if conn != nil && !conn.prove() {
		// Evicted or expired as its stream arrived: it is closed.
		return nil, status.Error(codes.Unavailable, "connection closed")
	}
	return context.WithValue(ctx, authnKey{}, au), nil
}

// identify returns the credential a stream presents: by its bearer token,
// by the client certificate its connection verified, or both (then they
// must agree). A wrong token, a revoked certificate or two credentials
// that disagree are refused, even where the other half alone would do.
// Tokens are looked up by their SHA-256 digest: the map lookup hashes the
// digest, so its timing tells a guesser nothing about the token.
func (n *node) identify(ctx context.Context, header metadata.MD) (authn, bool) {
	set := n.creds.Load()
	if set == nil {
		return authn{}, false
	}
	var au authn
	var byToken, byCert *credential
	if got := bearerToken(header); got != "" {
		au.tokenSum = sha256.Sum256([]byte(got))
		if byToken = set.byToken[au.tokenSum]; byToken == nil {
			return authn{}, false
		}
	}
	if chain := verifiedClientChain(ctx); chain != nil && set.clientCerts {
		cert := chain[0]
		if set.revoked[serialKey(cert)] {
			return authn{}, false
		}
		if byCert = set.byCertificate(chain); byCert != nil {
			au.serial, au.ca = serialKey(cert), set.caID
		}
	}
	switch {
	case byToken != nil && byCert != nil && byToken != byCert:
		return authn{}, false
	case set.requireCert && byCert == nil:
		// Any certificate of the CA passes the handshake (a tls internal
		// site's too): with require, only a credential's certificate
		// authenticates, never a token beside another certificate.
		return authn{}, false
	case byCert != nil:
		au.cred = byCert
	case byToken != nil:
		au.cred = byToken
	default:
		return authn{}, false
	}
	return au, true
}

// bearerToken returns the bearer token of a stream's headers; "" for none.
func bearerToken(header metadata.MD) string {
	v := header.Get("authorization")
	if len(v) == 0 {
		return ""
	}
	got, ok := strings.CutPrefix(v[0], "Bearer ")
	if !ok {
		return ""
	}
	return got
}

// verifiedClientChain returns the chain, from the client certificate up to
// the CA's root, that the stream's connection's TLS handshake verified;
// nil for none.
func verifiedClientChain(ctx context.Context) []*x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	ti := tlsInfoOf(p.AuthInfo)
	if ti == nil || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil
	}
	return ti.State.VerifiedChains[0]
}

// byCertificate returns the credential whose client identity a verified
// chain's leaf carries; nil for none. A DNS identity counts only on a leaf
// the root signed itself, as issue-cert's are: Caddy's CA also signs, with
// its intermediate, the certificates of `tls internal` sites and of an
// acme_server, which carry DNS names (and whoever passes an acme_server's
// challenge for a name would get one). A URI identity is never on those.
func (s *credentialSet) byCertificate(chain []*x509.Certificate) *credential {
	ids := certIdentities(chain[0])
	if len(chain) != 2 {
		ids = slices.DeleteFunc(ids, func(id string) bool { return !isURIIdentity(id) })
	}
	for _, id := range ids {
		if c := s.byIdentity[id]; c != nil {
			return c
		}
	}
	return nil
}

// authFailed counts a refused credential and, at its
// maxAuthFailuresPerConn-th, closes its connection if that has not
// authenticated: a connection that has (an agent's, or a proxy's that
// carries several clients' streams) keeps its sessions, and only the
// stream is refused.
func (n *node) authFailed(ctx context.Context, conn *guardedConn) {
	total := n.authFailures.Add(1)
	closed := conn != nil && conn.authFailures.Add(1) >= maxAuthFailuresPerConn && conn.closeIfPending()
	remote := "unknown"
	if p, ok := peer.FromContext(ctx); ok {
		remote = p.Addr.String()
	}
	if ok, suppressed := n.authLog.Allow(); ok {
		n.log().Warn("agent authentication failed: invalid or missing credential", zap.String("remote", remote),
			zap.Bool("connection_closed", closed), zap.Int64("failures_total", total),
			zap.Int("suppressed_since_last", suppressed))
	}
}

// errNotAuthenticated is a handler reached without the tap (a server set
// up without it): refused, never served.
var errNotAuthenticated = errors.New("stream did not pass the node's credential check")

// authenticated returns how the stream's tap authenticated it.
func authenticated(ctx context.Context) (authn, error) {
	if au, ok := ctx.Value(authnKey{}).(authn); ok {
		return au, nil
	}
	return authn{}, status.Error(codes.Unauthenticated, errNotAuthenticated.Error())
}

// applyCredentials brings the sessions in line with the node's current
// credentials, after a reload changed them took over: a session whose
// credential is gone, whose token changed or whose certificate was revoked
// ends (a rotated secret must lock out whoever held the old one, not only
// their next connection); one whose credential's scope changed has its
// routes admitted again under the new scope.
func (n *node) applyCredentials() {
	set := n.creds.Load()
	if set == nil {
		return
	}
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	ended, rescoped := 0, 0
	for _, a := range n.reg.sessions() {
		if !set.stillValid(a.auth) {
			a.sess.CloseWithError(errCredentialChanged)
			ended++
			continue
		}
		if cur := set.byName[a.auth.cred.name]; cur != a.auth.cred {
			sameScope := sameScopeSource(cur, a.auth.cred)
			a.setCredential(cur)
			if !sameScope {
				n.readmitLocked(a, a.advertised)
				rescoped++
			}
		}
	}
	if ended > 0 {
		n.log().Warn("sluice: credentials changed; ended the sessions whose credential is gone, changed or revoked", zap.Int("sessions", ended))
	}
	if rescoped > 0 {
		n.log().Info("sluice: credential scopes changed; routes admitted again", zap.Int("sessions", rescoped))
	}
}

// sameScopeSource reports whether two credentials have the same scope.
func sameScopeSource(a, b *credential) bool {
	if a.source == nil || b.source == nil {
		return a.source == b.source
	}
	return reflect.DeepEqual(a.source.Scope, b.source.Scope)
}
