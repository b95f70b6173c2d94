package caddymodule

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
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
var errUnauthenticated = status.Error(codes.Unauthenticated, "invalid or missing token")

// tokenKey is the context key of the token a stream authenticated with.
type tokenKey struct{}

// tapAuthenticate is the gRPC server's InTapHandle: it checks the stream's
// bearer token in constant time. A valid one proves the connection (it
// leaves the guard's pending pool) and rides on the stream's context to
// its handler (authenticatedToken); a wrong or missing one is counted,
// logged through a throttle, and closes the connection at its
// maxAuthFailuresPerConn-th.
func (n *node) tapAuthenticate(ctx context.Context, info *tap.Info) (context.Context, error) {
	token, ok := n.checkToken(info.Header)
	conn := guardedConnOf(ctx)
	if !ok {
		n.authFailed(ctx, conn)
		return nil, errUnauthenticated
	}
	if conn != nil && !conn.prove() {
		// Evicted or expired as its stream arrived: it is closed.
		return nil, status.Error(codes.Unavailable, "connection closed")
	}
	return context.WithValue(ctx, tokenKey{}, token), nil
}

// checkToken returns the node's token when header carries it as a bearer
// token. The digests are compared, not the tokens: ConstantTimeCompare
// returns at once on a length mismatch, which would tell a guesser the
// token's length.
func (n *node) checkToken(header metadata.MD) (string, bool) {
	var got string
	if v := header.Get("authorization"); len(v) > 0 {
		got, _ = strings.CutPrefix(v[0], "Bearer ")
		if len(got) == len(v[0]) {
			got = "" // no Bearer scheme
		}
	}
	want := n.token.Load()
	if want == nil || *want == "" || got == "" {
		return "", false
	}
	gotSum, wantSum := sha256.Sum256([]byte(got)), sha256.Sum256([]byte(*want))
	if subtle.ConstantTimeCompare(gotSum[:], wantSum[:]) != 1 {
		return "", false
	}
	return *want, true
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
		n.log().Warn("agent authentication failed: invalid or missing token", zap.String("remote", remote),
			zap.Bool("connection_closed", closed), zap.Int64("failures_total", total),
			zap.Int("suppressed_since_last", suppressed))
	}
}

// errNotAuthenticated is a handler reached without the tap (a server set
// up without it): refused, never served.
var errNotAuthenticated = errors.New("stream did not pass the node's credential check")

// authenticatedToken returns the token the stream's tap accepted.
func authenticatedToken(ctx context.Context) (string, error) {
	if t, ok := ctx.Value(tokenKey{}).(string); ok {
		return t, nil
	}
	return "", status.Error(codes.Unauthenticated, errNotAuthenticated.Error())
}

// errTokenChanged ends the sessions of agents that authenticated with a
// token a reload replaced: a rotated token must lock out whoever held the
// old one, not only their next connection.
var errTokenChanged = errors.New("the node's token changed; reconnect with the new one")

// endSessionsOfOldTokens ends the sessions that authenticated with a token
// other than the node's current one, after a reload that changed it took
// over, and logs how many.
func (n *node) endSessionsOfOldTokens() {
	cur := n.token.Load()
	if cur == nil {
		return
	}
	if ended := n.endSessionsWithout(*cur); ended > 0 {
		n.log().Warn("sluice: token changed; ended the sessions that authenticated with the old one", zap.Int("sessions", ended))
	}
}

// endSessionsWithout closes the sessions that authenticated with another
// token than token.
func (n *node) endSessionsWithout(token string) int {
	ended := 0
	for _, a := range n.reg.sessions() {
		if a.token != token {
			a.sess.CloseWithError(errTokenChanged)
			ended++
		}
	}
	return ended
}
