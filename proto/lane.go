package tunnelpb

// The data lane (proto/README §2.4): after the node authorised a Connect
// stream it may offer, in the stream's response header, a one-time ticket
// for a second connection to the same control address that then carries
// the session's frames without HTTP/2 around them.
const (
	// LaneHeader is the response header metadata key of the ticket.
	LaneHeader = "x-sluice-lane"
	// LanePreface starts a lane connection, followed by the ticket and a
	// newline. Its first byte tells it from an HTTP/2 client preface
	// ("PRI * HTTP/2.0…") on a shared listener.
	LanePreface = "SLUICE-LANE/1 "
	// LaneTicketLength is the length of a ticket: 32 hex digits.
	LaneTicketLength = 32
	// LaneAccepted is the byte the node answers a lane preface with when it
	// took the lane for the session; any other answer, or none, means it
	// did not, and the agent stays on the gRPC stream.
	LaneAccepted = 0x01
)

// LaneHello is what an agent writes first on a lane connection.
func LaneHello(ticket string) []byte {
	return []byte(LanePreface + ticket + "\n")
}

// LaneHelloLength is the length of LaneHello's bytes.
const LaneHelloLength = len(LanePreface) + LaneTicketLength + 1
