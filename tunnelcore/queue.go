package tunnelcore

// fifo is a slice-backed queue that reuses its storage once drained. A
// queue that is never drained (a sender's ready queue while two
// connections keep their frames coming) moves its items down over the
// popped ones instead of growing, so its storage stays within a few times
// the most it held, not the number of items that ever passed through it.
type fifo[T any] struct {
	items []T
	head  int // items[:head] are popped (zeroed)
}

func (q *fifo[T]) push(v T) {
	if len(q.items) == cap(q.items) && q.head > 0 && q.head >= len(q.items)/2 {
		// Full, and at least half of it popped: moving the live half
		// down costs no more than the pops that freed the room.
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items = q.items[:n]
		q.head = 0
	}
	q.items = append(q.items, v)
}

func (q *fifo[T]) len() int { return len(q.items) - q.head }

func (q *fifo[T]) pop() T {
	var zero T
	v := q.items[q.head]
	q.items[q.head] = zero
	q.head++
	if q.head == len(q.items) {
		q.items = q.items[:0]
		q.head = 0
	}
	return v
}

// drain removes and returns every item.
func (q *fifo[T]) drain() []T {
	out := append([]T(nil), q.items[q.head:]...)
	clear(q.items)
	q.items = q.items[:0]
	q.head = 0
	return out
}
