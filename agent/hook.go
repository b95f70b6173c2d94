package agent

import (
	"errors"
	"fmt"
	"syscall"
	"time"
)

// ConnOutcome is how a connection the node opened to the agent ended.
type ConnOutcome int

const (
	// ConnOK: relayed until both sides closed.
	ConnOK ConnOutcome = iota
	// ConnUnknownRoute: refused, the agent serves no route of that name.
	ConnUnknownRoute
	// ConnLimit: refused, the agent relays max_connections already.
	ConnLimit
	// ConnUpstreamRefused: the upstream refused the dial (nothing listens).
	ConnUpstreamRefused
	// ConnUpstreamFailed: the upstream could not be reached otherwise (a
	// timeout, its TLS handshake, the PROXY header).
	ConnUpstreamFailed
	// ConnAbandoned: the session ended while the upstream was dialed.
	ConnAbandoned
	// ConnReset: the relay ended on an error: either side reset or aborted
	// the connection, or the session ended under it.
	ConnReset
)

// String returns the outcome as a metric label or log field would carry it.
func (o ConnOutcome) String() string {
	switch o {
	case ConnOK:
		return "ok"
	case ConnUnknownRoute:
		return "unknown_route"
	case ConnLimit:
		return "limit"
	case ConnUpstreamRefused:
		return "upstream_refused"
	case ConnUpstreamFailed:
		return "upstream_failed"
	case ConnAbandoned:
		return "abandoned"
	case ConnReset:
		return "reset"
	}
	return fmt.Sprintf("ConnOutcome(%d)", int(o))
}

// ConnReport describes one connection the node opened to the agent, once
// it ended: the one seam where access lines, metrics or audits hang off the
// agent without each wrapping the connector (see WithConnEnd).
type ConnReport struct {
	// ID is the connection's id in its session, as the agent's debug logs
	// name it (conn_id).
	ID uint64
	// Route is the route the node routed the connection to (its name).
	Route string
	// Target is the route's upstream target as configured; "" when the
	// agent serves no such route.
	Target string
	// ClientAddr is the public client's address (host:port), when the
	// node knew it.
	ClientAddr string
	// FromClient and ToClient are the payload bytes relayed from the
	// client to the upstream and back; zero when there was no relay.
	FromClient, ToClient int64
	// OpenedAt is when the agent took the connection from the node;
	// Duration runs from then to its end.
	OpenedAt time.Time
	Duration time.Duration
	// Outcome is how it ended; Err why, nil for ConnOK.
	Outcome ConnOutcome
	Err     error
}

// WithConnEnd calls f once for every connection the node opens to the
// agent, when it has ended, whatever the outcome: refused, failed to reach
// its upstream, or relayed. f runs on the connection's goroutine (for a
// refused connection, on the session's accept loop), after the connection
// left ActiveConns and before Run can return, so it must be quick and may
// be called concurrently; a slow f holds up the next refusals.
func WithConnEnd(f func(ConnReport)) Option {
	return func(a *Agent) { a.onConnEnd = f }
}

// wsaeconnrefused is Windows' "connection refused", which its syscall
// package does not match with ECONNREFUSED.
const wsaeconnrefused = 10061

// refusedDial reports whether a dial failed because nothing listens at
// the target (ConnUpstreamRefused rather than ConnUpstreamFailed).
func refusedDial(err error) bool {
	var errno syscall.Errno
	return errors.Is(err, syscall.ECONNREFUSED) || (errors.As(err, &errno) && errno == wsaeconnrefused)
}
