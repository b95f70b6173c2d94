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
// (with the gRPC credentials
// wrapper that lets it read the socket's progress), the data lane's stream
// (ConnStream), and the relay that copies between a Conn and a real
// connection (splicing bulk payloads from a TCP socket into a plaintext
// lane, see splice.go).
//
// Nothing here knows about Caddy, routes or agents: callers exchange the
// session-level frames (Advertise, AdvertiseAck, Drain, ...) through
// Config.OnControl and Session.SendControl.
//
// The wire protocol is specified in proto/README.md.
package tunnelcore
