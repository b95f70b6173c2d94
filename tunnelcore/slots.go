package tunnelcore

import (
	"errors"
	"sync/atomic"
)

// ErrConnLimit is returned by Session.Open when the node's connection
// limit is reached.
var ErrConnLimit = errors.New("tunnel connection limit reached")

// Slots bounds the virtual connections open at once across every session
// that shares it. A slot is taken by Open (or by an accepted Connect) and
// given back only when the connection has ended and its queued frames have
// left the sender, so what a slot bounds is really released.
type Slots struct {
	limit atomic.Int64
	used  atomic.Int64
}

// NewSlots returns a limit of n connections; n <= 0 means no limit.
func NewSlots(n int64) *Slots {
	s := &Slots{}
	s.limit.Store(n)
	return s
}

// SetLimit changes the limit; connections above a lowered limit keep their
// slots.
func (s *Slots) SetLimit(n int64) { s.limit.Store(n) }

// TryAcquire takes a slot if one is free.
func (s *Slots) TryAcquire() bool {
	if s == nil {
		return true
	}
	for {
		limit := s.limit.Load()
		u := s.used.Load()
		if limit > 0 && u >= limit {
			return false
		}
		if s.used.CompareAndSwap(u, u+1) {
			return true
		}
	}
}

// Release gives a slot back.
func (s *Slots) Release() {
	if s != nil {
		s.used.Add(-1)
	}
}

// InUse returns the slots taken.
func (s *Slots) InUse() int64 {
	if s == nil {
		return 0
	}
	return s.used.Load()
}

// Limit returns the limit (<= 0: none).
func (s *Slots) Limit() int64 {
	if s == nil {
		return 0
	}
	return s.limit.Load()
}

// Full reports whether no slot is free.
func (s *Slots) Full() bool {
	if s == nil {
		return false
	}
	limit := s.limit.Load()
	return limit > 0 && s.used.Load() >= limit
}
