package tunnelpb

import "time"

// MaxRouteNameLength is the longest route name, in bytes, that a node
// accepts (README.md §12.3): names are echoed in acks, logs and Connect
// frames. Agents check it when they load their configuration.
const MaxRouteNameLength = 256

// MaxLeaveGrace is the longest grace a node gives an agent that leaves
// (Drain from the agent, README.md §13): past it plus a margin the node
// ends the session. Agents refuse a longer shutdown grace at load.
const MaxLeaveGrace = time.Hour

// Bounds on one Advertise (README.md §12.3): a node rejects the routes past
// MaxRoutesPerAdvertise, and the host patterns past the point where the
// Advertise's patterns together compile to more than
// MaxAdvertisePatternInsts regexp instructions. Agents check both when
// they load their configuration.
const (
	MaxRoutesPerAdvertise    = 1024
	MaxAdvertisePatternInsts = 20000
)

// MaxDatagramSize is the largest datagram a datagram flow carries, in
// bytes (README.md §6.1): a UDP datagram's payload fits in 65535 bytes
// (65507 over IPv4), so no UDP upstream or client can send a larger one. A
// receiver drops a larger Data frame on a flow, counting it; a sender
// refuses to queue one.
const MaxDatagramSize = 65535
