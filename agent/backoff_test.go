package agent

import (
	"testing"
	"time"
)

func TestBackoffBoundsAndDoubling(t *testing.T) {
	// randN returning 0 yields the lower bound, n-1 the upper bound.
	for _, tc := range []struct {
		name string
		pick func(n int64) int64
		want func(c time.Duration) time.Duration
	}{
		{"low", func(int64) int64 { return 0 }, func(c time.Duration) time.Duration { return c / 2 }},
		{"high", func(n int64) int64 { return n - 1 }, func(c time.Duration) time.Duration { return c }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackoff(time.Second, 30*time.Second, tc.pick)
			wantCeil := []time.Duration{1, 2, 4, 8, 16, 30, 30, 30}
			for i, c := range wantCeil {
				c *= time.Second
				if got := b.Ceiling(); got != c {
					t.Fatalf("step %d: ceiling %v, want %v", i, got, c)
				}
				if got := b.Next(); got != tc.want(c) {
					t.Fatalf("step %d: wait %v, want %v", i, got, tc.want(c))
				}
			}
			b.Reset()
			if got := b.Ceiling(); got != time.Second {
				t.Fatalf("after Reset: ceiling %v, want 1s", got)
			}
		})
	}
}

func TestBackoffRandomWithinUpperHalf(t *testing.T) {
	b := newBackoff(time.Second, 30*time.Second, nil)
	for i := 0; i < 1000; i++ {
		c := b.Ceiling()
		d := b.Next()
		if d < c/2 || d > c {
			t.Fatalf("wait %v outside [%v, %v]", d, c/2, c)
		}
		if i%10 == 9 {
			b.Reset()
		}
	}
}

func TestBackoffDefaults(t *testing.T) {
	b := newBackoff(0, 0, nil)
	if b.Ceiling() != defaultBackoffInitial || b.max != defaultBackoffInitial {
		t.Fatalf("got initial %v max %v", b.Ceiling(), b.max)
	}
	b = newBackoff(10*time.Millisecond, 25*time.Millisecond, func(n int64) int64 { return n - 1 })
	for _, want := range []time.Duration{10, 20, 25, 25} {
		if got := b.Next(); got != want*time.Millisecond {
			t.Fatalf("wait %v, want %v", got, want*time.Millisecond)
		}
	}
}
