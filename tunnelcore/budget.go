package tunnelcore

import "sync/atomic"

// Budget bounds the bytes that all receive windows above InitialWindow may
// hold at once, across every session of a node. A window grows only by what
// the budget grants, and gives it back as it shrinks or its connection ends.
// A Budget is safe for concurrent use.
type Budget struct {
	limit atomic.Int64
	used  atomic.Int64
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
