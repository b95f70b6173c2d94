package tunnelcore

import (
	"errors"
	"fmt"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Sentinel errors; check them with errors.Is.
var (
	// ErrSessionClosed: the session ended (its stream failed or it was
	// closed). Errors returned by a Conn of a dead session wrap it together
	// with the cause.
	ErrSessionClosed = errors.New("tunnel session closed")
	// ErrConnClosed: the Conn was closed locally.
	ErrConnClosed = errors.New("tunnel connection closed")
	// ErrWriteClosed: Write after CloseWrite.
	ErrWriteClosed = errors.New("tunnel connection write side closed")
	// ErrFlowControl: the peer sent data beyond the credit it was granted.
	ErrFlowControl = errors.New("tunnel peer exceeded its flow control credit")
	// ErrBacklogFull: the peer opened connections faster than they were accepted.
	ErrBacklogFull = errors.New("tunnel accept backlog full")
)

// PeerError is the reason a peer gave for aborting a connection (an Error
// frame). errors.Is(err, ErrConnReset) is true for every PeerError.
type PeerError struct {
	Code    tunnelpb.Error_Code
	Message string
}

// ErrConnReset matches every PeerError.
var ErrConnReset = errors.New("tunnel connection reset by peer")

func (e *PeerError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("tunnel connection reset by peer (%s)", e.Code)
	}
	return fmt.Sprintf("tunnel connection reset by peer (%s): %s", e.Code, e.Message)
}

// Is makes errors.Is(err, ErrConnReset) hold.
func (e *PeerError) Is(target error) bool { return target == ErrConnReset }

// timeoutError is returned when a deadline passes; it is a net.Error with
// Timeout() == true and matches os.ErrDeadlineExceeded.
type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }
func (timeoutError) Is(target error) bool {
	return target == errDeadlineExceeded
}

// sessionError wraps the cause of a session's end so that errors.Is matches
// both ErrSessionClosed and the cause.
type sessionError struct{ cause error }

func (e *sessionError) Error() string {
	if e.cause == nil {
		return ErrSessionClosed.Error()
	}
	return ErrSessionClosed.Error() + ": " + e.cause.Error()
}

func (e *sessionError) Unwrap() []error { return []error{ErrSessionClosed, e.cause} }
