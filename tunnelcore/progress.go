package tunnelcore

import (
	"context"
	"net"
	"sync/atomic"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Transport progress for the stall watchdog.
//
// A Send blocked on gRPC flow control says only that the stream is not
// moving as fast as the session writes; on a slow link one 256 KiB message
// can take longer than the stall timeout to drain while the peer reads
// everything it gets. What tells a stalled peer from a slow link is whether
// the connection under the stream still delivers bytes, which the kernel
// knows: TCP_INFO's bytes_acked is what the peer's TCP acknowledged.
// ProgressCredentials records a reader of it for every gRPC connection, at
// the handshake, where both ends can find it (the server through the
// stream's peer AuthInfo, the client through ProgressCredentials.Progress).

// stallProgressStep is the least a transport must deliver within the stall
// timeout to count as moving: one HTTP/2 frame. It keeps keepalive pings
// and connection-level window updates (a few bytes each) from hiding a
// stream that does not move.
const stallProgressStep = 16 << 10

// ProgressCreds wraps gRPC transport credentials so every connection's
// handshake records a reader of its socket's delivered bytes.
type ProgressCreds struct {
	credentials.TransportCredentials
	// last is the progress reader of the latest client handshake, shared
	// with clones (gRPC clones the credentials of a ClientConn).
	last *atomic.Pointer[func() uint64]
}

// ProgressCredentials wraps creds (nil: insecure, plaintext).
func ProgressCredentials(creds credentials.TransportCredentials) *ProgressCreds {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	return &ProgressCreds{TransportCredentials: creds, last: new(atomic.Pointer[func() uint64])}
}

// ClientHandshake implements credentials.TransportCredentials.
func (p *ProgressCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := p.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return conn, ai, err
	}
	f := socketProgress(raw)
	if f != nil {
		p.last.Store(&f)
	}
	return conn, withProgress(ai, f), nil
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
	return &ProgressCreds{TransportCredentials: p.TransportCredentials.Clone(), last: p.last}
}

// Progress returns a reader of the bytes delivered by the connection of
// the latest client handshake (0 until there is one, or where the platform
// cannot tell). A session on a ClientConn of its own uses it as
// Config.Progress.
func (p *ProgressCreds) Progress() func() uint64 {
	return func() uint64 {
		if f := p.last.Load(); f != nil {
			return (*f)()
		}
		return 0
	}
}

// ProgressOf returns the progress reader ProgressCredentials recorded in a
// connection's AuthInfo (the server side: peer.FromContext(ctx).AuthInfo),
// or nil.
func ProgressOf(ai credentials.AuthInfo) func() uint64 {
	if p, ok := ai.(progressAuthInfo); ok {
		return p.progress
	}
	return nil
}

// progressAuthInfo is the handshake's AuthInfo with the progress reader.
type progressAuthInfo struct {
	credentials.AuthInfo
	progress func() uint64
}

// GetCommonAuthInfo passes the wrapped security level through, so
// credentials.CheckSecurityLevel sees what the handshake established.
func (a progressAuthInfo) GetCommonAuthInfo() credentials.CommonAuthInfo {
	if c, ok := a.AuthInfo.(interface {
		GetCommonAuthInfo() credentials.CommonAuthInfo
	}); ok {
		return c.GetCommonAuthInfo()
	}
	return credentials.CommonAuthInfo{SecurityLevel: credentials.InvalidSecurityLevel}
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
