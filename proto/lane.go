package tunnelpb

import (
	"errors"
	"fmt"
	"strconv"
)

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

// ErrMalformedHello is the error of a lane or direct socket preface that
// is not one LaneHello or DirectHello writes.
var ErrMalformedHello = errors.New("malformed preface")

// ParseLaneHello returns the ticket of a LaneHello. It accepts exactly the
// bytes LaneHello writes for a ticket of LaneTicketLength lower-case hex
// digits (what the node hands out), so the ticket it returns can be looked
// up as it is: anything else is no ticket the node issued.
func ParseLaneHello(b []byte) (ticket string, err error) {
	p := len(LanePreface)
	if len(b) != LaneHelloLength || string(b[:p]) != LanePreface || b[len(b)-1] != '\n' {
		return "", fmt.Errorf("lane: %w", ErrMalformedHello)
	}
	t := b[p : len(b)-1]
	if !isLowerHex(t) {
		return "", fmt.Errorf("lane: %w: the ticket is not %d lower-case hex digits", ErrMalformedHello, LaneTicketLength)
	}
	return string(t), nil
}

// isLowerHex reports whether b is all lower-case hex digits.
func isLowerHex(b []byte) bool {
	for _, c := range b {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Direct sockets (proto/README §2.5): a node that offers a lane may also
// give the session a key with which the agent opens, for one connection at a
// time, a socket that carries that connection's bytes alone.
const (
	// DirectHeader is the response header metadata key of the session's
	// direct key (as long as a lane ticket).
	DirectHeader = "x-sluice-direct"
	// DirectPreface starts a direct socket, followed by the session's key,
	// the connection id in 16 hex digits and a newline. It is as long as
	// LanePreface and starts like it, so a listener reads the same prefix.
	DirectPreface = "SLUICE-CONN/1 "
	// DirectKeyLength is the length of a direct key: 32 hex digits.
	DirectKeyLength = 32
	// DirectNotOpen is the node's answer to a direct socket with the
	// session's key for a connection that is not open (any more), or has
	// a socket already: the path works, that connection stays on the
	// lane. (A wrong key gets no answer: the socket is closed.)
	DirectNotOpen = 0x02
)

// DirectHello is what an agent writes first on a direct socket.
func DirectHello(key string, connID uint64) []byte {
	b := make([]byte, 0, DirectHelloLength)
	b = append(b, DirectPreface...)
	b = append(b, key...)
	b = fmt.Appendf(b, "%016x\n", connID)
	return b
}

// DirectHelloLength is the length of DirectHello's bytes.
const DirectHelloLength = len(DirectPreface) + DirectKeyLength + 16 + 1

// ParseDirectHello returns the key and connection id of a DirectHello. Like
// ParseLaneHello it accepts exactly what DirectHello writes for a key of
// DirectKeyLength lower-case hex digits and a connection id other than 0:
// strconv alone would also take upper-case digits, so two prefaces would
// name one connection.
func ParseDirectHello(b []byte) (key string, connID uint64, err error) {
	p := len(DirectPreface)
	if len(b) != DirectHelloLength || string(b[:p]) != DirectPreface || b[len(b)-1] != '\n' {
		return "", 0, fmt.Errorf("direct socket: %w", ErrMalformedHello)
	}
	k, id := b[p:p+DirectKeyLength], b[p+DirectKeyLength:len(b)-1]
	if !isLowerHex(k) {
		return "", 0, fmt.Errorf("direct socket: %w: the key is not %d lower-case hex digits", ErrMalformedHello, DirectKeyLength)
	}
	if !isLowerHex(id) {
		return "", 0, fmt.Errorf("direct socket: %w: bad connection id", ErrMalformedHello)
	}
	// 16 hex digits always fit in a uint64.
	connID, err = strconv.ParseUint(string(id), 16, 64)
	if err != nil || connID == 0 {
		return "", 0, fmt.Errorf("direct socket: %w: bad connection id", ErrMalformedHello)
	}
	return string(k), connID, nil
}
