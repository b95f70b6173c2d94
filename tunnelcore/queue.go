package tunnelcore

// fifo is a slice-backed queue that reuses its storage once drained.
type fifo[T any] struct {
	items []T
	head  int
}

func (q *fifo[T]) push(v T) { q.items = append(q.items, v) }

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
