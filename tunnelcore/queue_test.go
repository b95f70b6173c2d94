package tunnelcore

import (
	"math/rand/v2"
	"testing"
)

// TestFifoThatNeverDrainsStaysSmall: a queue popped and refilled without
// ever running empty (a session's ready queue with two busy connections)
// keeps storage for what it holds, not for every item that passed.
func TestFifoThatNeverDrainsStaysSmall(t *testing.T) {
	for _, live := range []int{1, 2, 7, 64} {
		var q fifo[int]
		for i := range live {
			q.push(i)
		}
		for i := range 200_000 {
			if got, want := q.pop(), i; got != want {
				t.Fatalf("live %d: popped %d, want %d", live, got, want)
			}
			q.push(i + live)
		}
		if q.len() != live || cap(q.items) > 4*live+8 {
			t.Fatalf("live %d: len %d, storage for %d items after 200000 passed", live, q.len(), cap(q.items))
		}
	}
}

// TestFifoKeepsOrder: random pushes, pops and drains against a plain slice.
func TestFifoKeepsOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	var q fifo[int]
	var ref []int
	next := 0
	for range 100_000 {
		switch n := r.IntN(100); {
		case n < 55:
			q.push(next)
			ref = append(ref, next)
			next++
		case n < 99:
			if len(ref) == 0 {
				continue
			}
			if got := q.pop(); got != ref[0] {
				t.Fatalf("popped %d, want %d", got, ref[0])
			}
			ref = ref[1:]
		default:
			got := q.drain()
			if len(got) != len(ref) {
				t.Fatalf("drained %d items, want %d", len(got), len(ref))
			}
			for i := range got {
				if got[i] != ref[i] {
					t.Fatalf("drained item %d is %d, want %d", i, got[i], ref[i])
				}
			}
			ref = ref[:0]
		}
		if q.len() != len(ref) {
			t.Fatalf("len %d, want %d", q.len(), len(ref))
		}
	}
}

// TestFifoLetsGoOfWhatItMoved: compaction leaves no reference behind in the
// storage past the live items (a pooled buffer kept alive).
func TestFifoLetsGoOfWhatItMoved(t *testing.T) {
	var q fifo[*int]
	for i := range 8 {
		q.push(&i)
	}
	for range 6 {
		q.pop()
	}
	for i := range 5 { // the first finds the storage full: the live items move down
		q.push(&i)
	}
	if q.head != 0 || cap(q.items) != 8 {
		t.Fatalf("head %d, storage for %d: the items did not move down", q.head, cap(q.items))
	}
	for i, p := range q.items[q.len():cap(q.items)] {
		if p != nil {
			t.Fatalf("slot %d past the live items still holds a pointer", q.len()+i)
		}
	}
}
