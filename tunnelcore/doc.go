// Package tunnelcore owns the sluice tunnel below any server or agent: the
// session that multiplexes virtual connections over one frame stream (a gRPC
// Connect stream, or an in-memory pipe in tests), the virtual connection
// (Conn, a net.Conn with half-close and deadlines), the per-connection credit
// windows and the node-wide Budget that bounds what windows above 64 KiB may
// buffer, the sender that schedules control frames before connection frames
// and connections round-robin (its control queue is bounded: a peer whose
// frames make it queue answers faster than it reads them is read no further
// until they drain, see controlQueueBound; small DATA frames are charged the
// memory they hold, see smallPayload and minFrameCharge), the stall watchdog
// (with the gRPC credentials wrapper that lets it read the socket's
// progress), the data lane's stream (ConnStream), and the relay that copies
// between a Conn and a real connection (splicing bulk payloads from a TCP
// socket into a plaintext lane, see splice.go), and datagram flows: a Conn
// that carries whole UDP datagrams outside credit, through bounded queues
// that drop the newest datagram rather than wait (flow.go).
//
// Nothing here knows about Caddy, routes or agents: callers exchange the
// session-level frames (Advertise, AdvertiseAck, Drain, ...) through
// Config.OnControl and Session.SendControl, and learn how each connection
// ended through Config.OnConnEnd.
//
// The wire protocol is specified in proto/README.md.
//
// # Files
//
//   - session.go: Session (open, accept, end, the watchdog, Stats);
//     session_recv.go: the receive loop and the peer's Connect frames.
//   - conn.go: Conn, its life (connLife) and its end (Close, Abort, the
//     peer's abort, the session's end); conn_recv.go: the receive direction
//     (Read, WriteTo, DATA from the peer); conn_send.go: the send direction
//     (Write, ReadFrom, credit, CloseWrite); connend.go: ConnEnd.
//   - window.go, budget.go, recvbuf.go, slots.go: credit windows, the
//     node-wide budget, the receive buffer, the connection limit.
//   - sender.go: the sender and each connection's place in it (sendSched);
//     sender_control.go: the control queue.
//   - lane.go: the data lane's stream (frames on a raw socket); splice*.go:
//     moving payloads from a socket into the lane inside the kernel.
//   - direct.go: direct sockets (a connection moved to a socket of its own)
//     and their state; direct_io.go: reading, writing and closing them.
//   - relay.go: copying between a Conn and a real connection.
//   - flow.go: datagram flows (their state behind Conn.flow, the idle
//     timer, the counts); flow_io.go: writing, receiving and reading
//     datagrams; flow_relay.go: relaying a flow to a UDP socket
//     (flow_relay_unix.go: reading a socket without holding a buffer
//     while it is idle).
//   - stream.go: FrameStream, the gRPC stream and the in-memory Pipe;
//     progress*.go: what the transport under a stream delivered (for the
//     stall watchdog); config.go, errors.go, pool.go, queue.go,
//     deadline.go, memory.go: configuration, errors, buffers, the FIFO,
//     deadlines, limits derived from memory.
//
// # Connection state
//
// A Conn has one state per direction and one for its life, all guarded by
// Conn.mu: recvState (open, EOF, failed), sendState (open, FIN queued,
// moved to the direct socket, failed) and connLife (open, closed, broken,
// both, aborted here). The fast paths stay behind seams: the sender reaches
// the lane through small optional interfaces (batchingStream,
// splicingStream), and a Conn reaches its direct socket through one
// pointer, Conn.direct, nil unless a socket is being opened or attached; a
// directSocket keeps where each direction stands on it. A datagram flow is
// a Conn whose Conn.flow is set: Read, Write, ReadFrom, WriteTo, the
// receive loop's DATA and WindowUpdate check that pointer first and take
// the flow's own paths; the sender's queues and the connection's life,
// Close and abort are shared.
//
// # Locks
//
// Each lock is declared beside the fields it guards:
//
//   - Conn.wlock, a channel of one, serialises Write and ReadFrom (it
//     guards no field: the writer that holds it is the one that may move
//     the direction to a direct socket).
//   - Conn.mu guards the connection's state, buffers and credit.
//   - directSocket.mu guards the socket and where each direction stands on
//     it.
//   - Session.mu guards the table of connections.
//   - sender.mu guards the sender's queues and each connection's sendSched
//     (embedded in Conn, declared in sender.go).
//   - flowState.mu guards a flow's idle timer.
//   - Slots.mu, pipePool.mu and deadline.mu guard their own types.
//
// The order, outermost first, where one is taken while holding another:
//
//	Conn.wlock → Conn.mu → directSocket.mu
//	Conn.wlock → sender.mu
//	Conn.mu → deadline.mu
//	Conn.mu → flowState.mu
//	Session.mu → Slots.mu
//
// sender.mu is taken under none of Conn.mu, directSocket.mu and Session.mu,
// and takes no lock itself: a connection's state and its place in the
// sender are read and changed one after the other, never together
// (Conn.queued, which both change, is an atomic). Config.OnConnEnd and the
// whenBroken hooks run with no lock held.
package tunnelcore
