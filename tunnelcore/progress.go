package tunnelcore

import (
	"context"
	"fmt"
	"net"

	"google.golang.org/grpc/credentials"
)

// Transport progress for the stall watchdog.
//
// A Send blocked on gRPC flow control says only that the stream is not
// moving as fast as the session writes; on a slow link one 256 KiB message
// can take longer than the stall timeout to drain while the peer reads
// everything it gets. What tells a stalled peer from a slow link is whether
// the connection under the stream still delivers bytes, which the kernel
// knows: TCP_INFO's bytes_acked is what the peer's TCP acknowledged.
// ProgressCredentials records a reader of it in every gRPC connection's
// AuthInfo at the handshake, where either end finds it through its stream's
// context (peer.FromContext(stream.Context()).AuthInfo, then ProgressOf).

// stallProgressStep is the least a transport must deliver within the stall
// timeout to count as moving: one HTTP/2 frame. It keeps keepalive pings
// and connection-level window updates (a few bytes each, about 70 bytes a
// minute between sluice ends) from hiding a stream that does not move.
const stallProgressStep = 16 << 10

// ProgressCreds wraps gRPC transport credentials so every connection's
// handshake records a reader of its socket's delivered bytes.
type ProgressCreds struct {
	credentials.TransportCredentials
}

// ProgressCredentials wraps creds, which must not be nil (for plaintext,
// pass insecure.NewCredentials()).
func ProgressCredentials(creds credentials.TransportCredentials) *ProgressCreds {
	if creds == nil {
		panic("tunnelcore: ProgressCredentials of nil credentials")
	}
	return &ProgressCreds{TransportCredentials: creds}
}

// ClientHandshake implements credentials.TransportCredentials.
func (p *ProgressCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := p.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return conn, ai, err
	}
	return conn, withProgress(ai, socketProgress(raw)), nil
}

// ServerHandshake implements credentials.TransportCredentials.
func (p *ProgressCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := p.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, ai, err
	}
	return conn, withProgress(ai, socketProgress(raw)), nil
}

// Clone implements credentials.TransportCredentials.
func (p *ProgressCreds) Clone() credentials.TransportCredentials {
	return &ProgressCreds{TransportCredentials: p.TransportCredentials.Clone()}
}

// ProgressOf returns the progress reader ProgressCredentials recorded in a
// connection's AuthInfo, or nil (other credentials, a connection that is not
// TCP underneath, a platform without TCP_INFO).
func ProgressOf(ai credentials.AuthInfo) func() uint64 {
	// Looks through AuthInfos that wrap this one (the node's own, which
	// names the connection under it).
	for range 8 {
		switch a := ai.(type) {
		case progressAuthInfo:
			return a.progress
		case interface{ Unwrap() credentials.AuthInfo }:
			ai = a.Unwrap()
		default:
			return nil
		}
	}
	return nil
}

// progressAuthInfo is the handshake's AuthInfo with the progress reader. It
// passes on the optional interfaces gRPC looks for on an AuthInfo (security
// level, :authority validation, channelz security details) and Unwrap gives
// the wrapped one, for code that needs its concrete type (credentials.TLSInfo).
type progressAuthInfo struct {
	credentials.AuthInfo
	progress func() uint64
}

// Unwrap returns the AuthInfo of the wrapped credentials.
func (a progressAuthInfo) Unwrap() credentials.AuthInfo { return a.AuthInfo }

// GetCommonAuthInfo passes the wrapped security level on, so
// credentials.CheckSecurityLevel sees what the handshake established.
func (a progressAuthInfo) GetCommonAuthInfo() credentials.CommonAuthInfo {
	if c, ok := a.AuthInfo.(interface {
		GetCommonAuthInfo() credentials.CommonAuthInfo
	}); ok {
		return c.GetCommonAuthInfo()
	}
	return credentials.CommonAuthInfo{SecurityLevel: credentials.InvalidSecurityLevel}
}

// ValidateAuthority implements credentials.AuthorityValidator when the
// wrapped AuthInfo does, and refuses overrides as gRPC would when it does
// not.
func (a progressAuthInfo) ValidateAuthority(authority string) error {
	if v, ok := a.AuthInfo.(credentials.AuthorityValidator); ok {
		return v.ValidateAuthority(authority)
	}
	return fmt.Errorf("credentials type %q do not validate :authority overrides", a.AuthType())
}

// GetSecurityValue implements credentials.ChannelzSecurityInfo.
func (a progressAuthInfo) GetSecurityValue() credentials.ChannelzSecurityValue {
	if v, ok := a.AuthInfo.(credentials.ChannelzSecurityInfo); ok {
		return v.GetSecurityValue()
	}
	return nil
}

func withProgress(ai credentials.AuthInfo, f func() uint64) credentials.AuthInfo {
	if f == nil || ai == nil {
		return ai
	}
	return progressAuthInfo{AuthInfo: ai, progress: f}
}

// tcpConnOf finds the TCP connection under c, looking through wrappers that
// expose the connection they wrap.
func tcpConnOf(c net.Conn) *net.TCPConn {
	for range 8 {
		switch x := c.(type) {
		case *net.TCPConn:
			return x
		case interface{ NetConn() net.Conn }:
			c = x.NetConn()
		default:
			return nil
		}
	}
	return nil
}
