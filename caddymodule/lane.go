package caddymodule

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The data lane (proto/README §2.4). An authorised Connect stream is offered
// a one-time ticket in its response header; the agent may open a second
// connection to the control address, present the ticket, and run the
// session's frames on it (tunnelcore.ConnStream) instead of on the gRPC
// stream, which stays open beside it to carry the session's end status and
// gRPC's keepalive. Through gRPC, every byte crosses HTTP/2 framing in
// 16 KiB frames, a copy into and out of gRPC's buffers on each side and a
// hand-off to and from gRPC's reader and writer goroutines; on the lane it
// is one writev and one large read (bench/README.md has the figures).
//
// Lane connections share the control listener: laneCreds looks at the
// first byte after the TLS handshake (or, in plaintext, the first byte),
// takes a connection that starts with tunnelpb.LanePreface out of gRPC,
// and lets every other through.

// laneTickets are the tickets the node offered and no lane has claimed yet.
type laneTickets struct {
	mu sync.Mutex
	m  map[string]chan net.Conn
}

// offer makes a ticket; the lane that presents it arrives on the returned
// channel. withdraw forgets the ticket and closes a lane that arrived and
// was not taken.
func (t *laneTickets) offer() (ticket string, lanes <-chan net.Conn, withdraw func()) {
	ticket = randomHex(tunnelpb.LaneTicketLength)
	ch := make(chan net.Conn, 1)
	t.mu.Lock()
	if t.m == nil {
		t.m = make(map[string]chan net.Conn)
	}
	t.m[ticket] = ch
	t.mu.Unlock()
	return ticket, ch, func() {
		t.mu.Lock()
		delete(t.m, ticket)
		t.mu.Unlock()
		select {
		case c := <-ch:
			c.Close()
		default:
		}
	}
}

// claim hands conn to the offer of ticket, once: false for a ticket that is
// unknown, already claimed or withdrawn, or when admit, called once the
// ticket checked out and before the hand-off, refuses.
func (t *laneTickets) claim(ticket string, conn net.Conn, admit func() bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ch, ok := t.m[ticket]
	if !ok || !admit() {
		return false
	}
	delete(t.m, ticket)
	// Under the lock, so withdraw sees either the ticket or the conn.
	// Buffered, and each ticket is claimed once: no wait.
	ch <- conn
	return true
}

// randomHex returns n random hex digits (n even).
func randomHex(n int) string {
	b := make([]byte, n/2)
	if _, err := rand.Read(b); err != nil {
		panic("sluice: crypto/rand: " + err.Error())
	}
	return hex.EncodeToString(b)
}

// directKeys maps the keys of sessions that take direct sockets
// (proto/README §2.5) to their sessions.
type directKeys struct {
	mu sync.Mutex
	m  map[string]*tunnelcore.Session
	// off reports whether the node's direct_sockets is off now: a reload
	// that turned it off refuses the sockets of the sessions offered a
	// key before. Nil: on.
	off func() bool
}

// errDirectOff is a direct socket that came after a reload turned
// direct_sockets off.
var errDirectOff = errors.New("direct_sockets is off")

func (k *directKeys) register(key string, s *tunnelcore.Session) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = make(map[string]*tunnelcore.Session)
	}
	k.m[key] = s
}

func (k *directKeys) forget(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, key)
}

// errDirectKey is a direct socket whose key names no session on this node.
var errDirectKey = errors.New("direct socket key names no session")

// attach hands conn to connection id of the session with key, once admit,
// called when the key checked out, agreed.
func (k *directKeys) attach(key string, id uint64, conn net.Conn, admit func() bool) error {
	if k.off != nil && k.off() {
		return errDirectOff
	}
	k.mu.Lock()
	var s *tunnelcore.Session
	for known, sess := range k.m {
		// Compared in constant time, as the token is.
		if subtle.ConstantTimeCompare([]byte(known), []byte(key)) == 1 {
			s = sess
		}
	}
	k.mu.Unlock()
	if s == nil {
		return errDirectKey
	}
	if !admit() {
		return errEvicted
	}
	return s.AttachDirect(id, conn)
}

// laneCreds wraps the control plane's transport credentials: after the
// handshake, a connection that starts with a lane preface is handed to the
// ticket it presents and leaves gRPC (credentials.ErrConnDispatched).
type laneCreds struct {
	credentials.TransportCredentials
	tickets *laneTickets
	direct  *directKeys
	refused func(remote net.Addr, what string, err error) // a lane or direct socket that was not taken ("data lane", "direct socket")
}

// errLaneTicket is a lane preface whose ticket no Connect stream is
// waiting for (unknown, claimed, or given up). errEvicted is a lane or
// direct socket the guard closed (too slow, or evicted) as it presented
// a valid one.
var (
	errLaneTicket = errors.New("lane ticket is not waiting for a lane")
	errEvicted    = errors.New("the connection was closed while pending")
)

// ServerHandshake implements credentials.TransportCredentials. gRPC's
// connection timeout bounds the handshake: its deadline on raw lasts until
// the handshake returns. A gRPC connection's AuthInfo names the guarded
// connection, which stays pending until a stream authenticates
// (node.tapAuthenticate).
func (c *laneCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, ai, err
	}
	guarded, _ := raw.(*guardedConn)
	var first [1]byte
	if _, err := io.ReadFull(conn, first[:]); err != nil {
		conn.Close()
		return nil, nil, err
	}
	if first[0] != tunnelpb.LanePreface[0] {
		peeked := &peekedConn{Conn: conn, first: first[0], unread: true}
		if guarded != nil {
			ai = guardAuthInfo{AuthInfo: ai, conn: guarded}
			if conn == raw { // plaintext: gRPC may read the socket itself (readyConn)
				return readyConnOf(peeked, guarded.Conn), ai, nil
			}
		}
		return peeked, ai, nil
	}
	// A lane or direct socket: it stays pending until its ticket or key
	// checked out, and must send its preface within the guard's preface
	// time. It runs on the socket itself, which a plaintext lane writes
	// with writev and splices into.
	admit := func() bool { return true }
	if guarded != nil {
		admit = guarded.prove
		raw.SetReadDeadline(time.Now().Add(guarded.g.timing.Load().preface))
		if conn == raw {
			conn = guarded.Conn
		}
		raw = guarded.Conn
	}
	if what, err := c.take(tunnelcore.OverSocket(conn, raw), guarded, admit); err != nil {
		conn.Close()
		if guarded != nil {
			guarded.Close() // leaves the pending pool
		}
		if c.refused != nil {
			c.refused(raw.RemoteAddr(), what, err)
		}
	}
	return nil, nil, credentials.ErrConnDispatched
}

// take reads the rest of a lane or direct socket preface and hands conn
// to the ticket or the connection it names; what says which it was.
func (c *laneCreds) take(conn net.Conn, guarded *guardedConn, admit func() bool) (what string, err error) {
	hello := make([]byte, max(tunnelpb.LaneHelloLength, tunnelpb.DirectHelloLength))
	hello[0] = tunnelpb.LanePreface[0]
	prefix := len(tunnelpb.LanePreface)
	const lane, direct = "data lane", "direct socket"
	if _, err := io.ReadFull(conn, hello[1:prefix]); err != nil {
		return lane, fmt.Errorf("reading the lane preface: %w", err)
	}
	if string(hello[:prefix]) == tunnelpb.DirectPreface {
		hello = hello[:tunnelpb.DirectHelloLength]
		if _, err := io.ReadFull(conn, hello[prefix:]); err != nil {
			return direct, fmt.Errorf("reading the direct socket preface: %w", err)
		}
		key, id, err := tunnelpb.ParseDirectHello(hello)
		if err != nil {
			return direct, err
		}
		if err := conn.SetReadDeadline(time.Time{}); err != nil {
			return direct, err
		}
		if guarded != nil {
			guarded.direct.Store(true)
		}
		err = c.direct.attach(key, id, conn, admit)
		if errors.Is(err, tunnelcore.ErrNotDirect) {
			// The key is right: tell the agent it is the connection, not
			// the path (its other connections may still go direct).
			conn.SetWriteDeadline(time.Now().Add(time.Second))
			conn.Write([]byte{tunnelpb.DirectNotOpen})
		}
		return direct, err
	}
	hello = hello[:tunnelpb.LaneHelloLength]
	if _, err := io.ReadFull(conn, hello[prefix:]); err != nil {
		return lane, fmt.Errorf("reading the lane preface: %w", err)
	}
	ticket, err := tunnelpb.ParseLaneHello(hello)
	if err != nil {
		return lane, err
	}
	if err := conn.SetReadDeadline(time.Time{}); err != nil {
		return lane, err
	}
	if !c.tickets.claim(ticket, conn, admit) {
		return lane, errLaneTicket
	}
	return lane, nil
}

// Clone implements credentials.TransportCredentials.
func (c *laneCreds) Clone() credentials.TransportCredentials {
	return &laneCreds{TransportCredentials: c.TransportCredentials.Clone(), tickets: c.tickets, direct: c.direct, refused: c.refused}
}

// peekedConn gives back the byte laneCreds read to tell a lane from gRPC.
// It does not expose the socket (syscall.Conn): a reader of the socket
// itself would skip that byte.
type peekedConn struct {
	net.Conn
	first  byte
	unread bool // Read has not returned first yet; only gRPC's reader reads
}

func (p *peekedConn) Read(b []byte) (int, error) {
	if p.unread && len(b) > 0 {
		p.unread = false
		b[0] = p.first
		return 1, nil
	}
	return p.Conn.Read(b)
}

// NetConn returns the wrapped connection (tunnelcore's socket progress
// looks through it for the TCP socket).
func (p *peekedConn) NetConn() net.Conn { return p.Conn }

// laneStream is a node session's FrameStream on a lane. Closing it ends
// what the node sends on the lane, after what it flushed (a half-close, so
// that the agent reads the last frames, such as the answer to its Drain,
// where a close with its frames unread would reset the connection and
// could discard them), and ends the gRPC stream beside it, which carries
// the session's status. Connect closes the lane when it returns.
type laneStream struct {
	tunnelcore.LaneStream
	endGRPC func()
}

func (l *laneStream) Close(cause error) {
	l.CloseWrite()
	l.endGRPC()
}

// Interface guards
var _ credentials.TransportCredentials = (*laneCreds)(nil)

// offerLane offers the stream a data lane (unless the node's data_lane is
// off) and with it direct sockets (unless direct_sockets is off) in the
// response header, which it sends at once either way: an agent waits for
// the header before it sends its Advertise. The lane that claims the
// ticket arrives on lanes; withdraw gives the offer up. directKey is the
// key the session's direct sockets will present, once registered.
func (n *node) offerLane(stream grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) (lanes <-chan net.Conn, directKey string, withdraw func()) {
	md := metadata.MD{}
	withdraw = func() {}
	if opts := n.opts.Load(); !opts.noDataLane {
		var ticket string
		ticket, lanes, withdraw = n.lanes.offer()
		md.Set(tunnelpb.LaneHeader, ticket)
		if !opts.noDirectSockets {
			directKey = randomHex(tunnelpb.DirectKeyLength)
			md.Set(tunnelpb.DirectHeader, directKey)
		}
	}
	if err := stream.SendHeader(md); err != nil {
		withdraw()
		return nil, "", func() {}
	}
	return lanes, directKey, withdraw
}

// laneLinger bounds how long a lane whose session ended waits for the
// agent to close its end before the node closes it (closeLane).
const laneLinger = time.Second

// closeLane closes a lane. After a session, the node has half-closed it
// (laneStream.Close) and the session's receive loop reads what the agent
// still sends until the agent, having read the node's last frames, closes
// its end; only then is the lane closed, as closing it with bytes unread
// would reset it and could discard what the agent had not read yet (such
// as the answer to its Drain). An agent that does not close within
// laneLinger is cut.
func closeLane(lane tunnelcore.LaneStream, sessionRan bool) {
	if sessionRan {
		lane.CloseWrite()
		t := time.NewTimer(laneLinger)
		select {
		case <-lane.RecvEnded():
		case <-t.C:
		}
		t.Stop()
	}
	lane.Close(nil)
}

// endWithGRPCStream ends a session on a data lane when the gRPC stream
// beside it ends, or carries a frame it must not.
func endWithGRPCStream(sess *tunnelcore.Session, grpcRecv <-chan recvResult) {
	select {
	case r := <-grpcRecv:
		if r.err == nil {
			r.env.Payload.Free()
			r.err = errFrameBesideLane
		}
		sess.CloseWithError(r.err)
	case <-sess.Done():
	}
}

// directKeys returns the node's direct socket keys, refusing sockets
// while the current config has direct_sockets off.
func (n *node) directKeys() *directKeys {
	n.direct.off = func() bool { return n.opts.Load().noDirectSockets }
	return &n.direct
}

// laneRefused logs a lane connection that presented no ticket the node is
// waiting for (a lane that came too late, or not an agent), or a direct
// socket whose key or connection the node does not have (what names
// which).
func (n *node) laneRefused(remote net.Addr, what string, err error) {
	if ok, suppressed := n.streamLog.Allow(); ok {
		n.log().Info(what+" refused", zap.Stringer("remote", remote), zap.Error(err),
			zap.Int("suppressed_since_last", suppressed))
	}
}
