package tunnelcore

import (
	"errors"
	"fmt"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// ConnOutcome is how a virtual connection ended (ConnEnd).
type ConnOutcome int

const (
	// ConnClosed: closed cleanly (Close, after whatever half-closes).
	ConnClosed ConnOutcome = iota
	// ConnPeerAborted: reset or aborted by the peer (its Error frame).
	ConnPeerAborted
	// ConnAborted: aborted by this end (Abort).
	ConnAborted
	// ConnRefused: refused, by the peer (it could not or would not take a
	// connection this end opened) or by this end (accept backlog full).
	ConnRefused
	// ConnSessionEnded: its session ended while it was open.
	ConnSessionEnded
	// ConnFailed: failed by an error this end found (the peer broke the
	// protocol or its credit, a direct socket failed).
	ConnFailed
)

func (o ConnOutcome) String() string {
	switch o {
	case ConnClosed:
		return "closed"
	case ConnPeerAborted:
		return "peer_aborted"
	case ConnAborted:
		return "aborted"
	case ConnRefused:
		return "refused"
	case ConnSessionEnded:
		return "session_ended"
	case ConnFailed:
		return "error"
	}
	return fmt.Sprintf("ConnOutcome(%d)", int(o))
}

// ConnEnd describes a virtual connection that is fully finished: both
// directions done or aborted and its slot released (Config.OnConnEnd).
type ConnEnd struct {
	// ID is the connection id on the wire.
	ID uint64
	// Info is what the opener announced (route key, client address, SNI,
	// and on the opening end its Tag).
	Info ConnectInfo
	// OpenedHere is true when this end opened the connection (Open),
	// false when the peer did (Accept).
	OpenedHere bool
	// Read and Written are the payload bytes read from and written to the
	// connection, as Conn.Counts reports them (direct socket included).
	Read, Written int64
	// Opened is when the connection was made; Duration how long it lived.
	Opened   time.Time
	Duration time.Duration
	// Direct is true when the connection moved to a direct socket.
	Direct bool
	// Outcome is how it ended, Err the error it ended with (nil for
	// ConnClosed).
	Outcome ConnOutcome
	Err     error
}

// failOutcome is the outcome of a connection this end failed with err.
func failOutcome(err error) ConnOutcome {
	switch {
	case err == ErrConnClosed:
		return ConnAborted
	case errors.Is(err, ErrBacklogFull):
		return ConnRefused
	}
	return ConnFailed
}

// refusal reports whether an Error frame with code is the peer refusing a
// connection rather than aborting it.
func refusal(code tunnelpb.Error_Code) bool {
	switch code {
	case tunnelpb.Error_REFUSED, tunnelpb.Error_DIAL_FAILED, tunnelpb.Error_RESOURCE_EXHAUSTED:
		return true
	}
	return false
}

// endReport is c's ConnEnd, as of now.
func (c *Conn) endReport() ConnEnd {
	read, written := c.Counts()
	c.mu.Lock()
	how, err := c.endHow, c.endErr
	c.mu.Unlock()
	return ConnEnd{
		ID:         c.id,
		Info:       c.info,
		OpenedHere: c.openedHere(),
		Read:       read,
		Written:    written,
		Opened:     c.opened,
		Duration:   time.Since(c.opened),
		Direct:     c.direct.Load().socket() != nil,
		Outcome:    how,
		Err:        err,
	}
}
