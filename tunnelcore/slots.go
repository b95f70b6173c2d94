package tunnelcore

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
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
	// closing counts the slots of connections that have begun to end:
	// they come back as soon as their last frames leave the sender.
	closing atomic.Int64

	// waiting counts WaitFree callers; Release and endClosing signal them
	// only then.
	waiting  atomic.Int32
	mu       sync.Mutex
	released chan struct{} // closed by the next signal (Release, endClosing); nil when none waits
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
	if s == nil {
		return
	}
	s.used.Add(-1)
	s.signal()
}

// signal wakes the WaitFree callers, if any, to look again.
func (s *Slots) signal() {
	if s.waiting.Load() > 0 {
		s.mu.Lock()
		if s.released != nil {
			close(s.released)
			s.released = nil
		}
		s.mu.Unlock()
	}
}

// beginClosing counts a slot whose connection has begun to end;
// endClosing undoes it once the slot is released.
func (s *Slots) beginClosing() {
	if s != nil {
		s.closing.Add(1)
	}
}

func (s *Slots) endClosing() {
	if s != nil {
		s.closing.Add(-1)
		s.signal() // a waiter that lost the slot to another sees none closing
	}
}

// Closing returns the slots whose connections are ending and will give
// them back once their last frames are sent.
func (s *Slots) Closing() int64 {
	if s == nil {
		return 0
	}
	return max(s.closing.Load(), 0)
}

// WaitFree reports whether a slot is free, waiting for one up to d (or
// until ctx ends) only while some connection holding a slot is closing and
// fewer callers wait than slots are coming back: with none closing nothing
// would free a slot soon, and it returns false at once. It takes no slot;
// the caller's Open does, and may still find a slot taken by another
// caller first.
func (s *Slots) WaitFree(ctx context.Context, d time.Duration) bool {
	if !s.Full() {
		return true
	}
	if d <= 0 {
		return false
	}
	if n := s.waiting.Add(1); int64(n) > s.Closing() {
		s.waiting.Add(-1)
		return false
	}
	defer s.waiting.Add(-1)
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		// Take the signal before checking, so a Release between the check
		// and the wait is not missed.
		signal := s.releaseSignal()
		if !s.Full() {
			return true
		}
		if s.Closing() == 0 {
			return false
		}
		select {
		case <-signal:
		case <-timer.C:
			return !s.Full()
		case <-ctx.Done():
			return false
		}
	}
}

func (s *Slots) releaseSignal() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.released == nil {
		s.released = make(chan struct{})
	}
	return s.released
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
