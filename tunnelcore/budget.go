package tunnelcore

import "sync/atomic"

// Budget bounds the bytes that all receive windows above InitialWindow may
// hold at once, across every session of a node. A window grows only by what
// the budget grants, and gives it back as it shrinks or its connection ends.
//
// One connection grows only within its share: the limit over the number of
// connections holding part of the budget plus one, so the holders always
// leave room for one more. Without it the first few bulk transfers would
// take a small budget whole and every later one would stay at
// InitialWindow. A Budget is safe for concurrent use.
type Budget struct {
	limit   atomic.Int64
	used    atomic.Int64
	holders atomic.Int64 // connections with a charge above 0
}

// NewBudget returns a budget of limit bytes. limit <= 0 grants nothing, so
// every window stays at InitialWindow.
func NewBudget(limit int64) *Budget {
	b := &Budget{}
	b.SetLimit(limit)
	return b
}

// SetLimit changes the budget's size; charges above a lowered limit are
// kept until released.
func (b *Budget) SetLimit(limit int64) { b.limit.Store(max(limit, 0)) }

// TryAcquire charges n bytes if they fit and reports whether it did.
func (b *Budget) TryAcquire(n int64) bool {
	for {
		used := b.used.Load()
		if used+n > b.limit.Load() {
			return false
		}
		if b.used.CompareAndSwap(used, used+n) {
			return true
		}
	}
}

// grow charges n more bytes to a connection that holds charged bytes now,
// if they fit both the budget and the connection's share.
func (b *Budget) grow(charged, n int64) bool {
	holders := b.holders.Load()
	if charged == 0 {
		holders++ // this connection becomes a holder
	}
	if charged+n > b.limit.Load()/(holders+1) {
		return false
	}
	if !b.TryAcquire(n) {
		return false
	}
	if charged == 0 {
		b.holders.Add(1)
	}
	return true
}

// shrink gives back n of a connection's charged bytes.
func (b *Budget) shrink(charged, n int64) {
	if n <= 0 {
		return
	}
	b.Release(n)
	if charged-n == 0 {
		b.holders.Add(-1)
	}
}

// Holders returns how many connections hold part of the budget.
func (b *Budget) Holders() int64 { return b.holders.Load() }

// Release gives back n bytes charged earlier.
func (b *Budget) Release(n int64) {
	if n > 0 {
		b.used.Add(-n)
	}
}

// InUse returns the bytes currently charged.
func (b *Budget) InUse() int64 { return b.used.Load() }

// Limit returns the budget's size in bytes.
func (b *Budget) Limit() int64 { return b.limit.Load() }
