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

func TestBackoffSpread(t *testing.T) {
	low := func(int64) int64 { return 0 }
	high := func(n int64) int64 { return n - 1 }
	for _, tc := range []struct {
		name   string
		pick   func(int64) int64
		spread time.Duration
		want   time.Duration
	}{
		// Above the ceiling (1 s after Reset): [initial/2, spread].
		{"spread low", low, 20 * time.Second, 500 * time.Millisecond},
		{"spread high", high, 20 * time.Second, 20 * time.Second},
		// Not above the ceiling, or none: as Next, [ceiling/2, ceiling].
		{"at ceiling high", high, time.Second, time.Second},
		{"below ceiling low", low, 600 * time.Millisecond, 500 * time.Millisecond},
		{"none high", high, 0, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackoff(time.Second, 30*time.Second, tc.pick)
			if got := b.Spread(tc.spread); got != tc.want {
				t.Fatalf("Spread(%v) = %v, want %v", tc.spread, got, tc.want)
			}
			// A failed attempt after it backs off as after Next: the
			// ceiling doubled once.
			if got := b.Ceiling(); got != 2*time.Second {
				t.Fatalf("ceiling after Spread %v, want 2s", got)
			}
		})
	}
	// The spread is compared with the current ceiling, not the initial.
	b := newBackoff(time.Second, 30*time.Second, high)
	b.Next()
	b.Next() // ceiling 4 s
	if got := b.Spread(3 * time.Second); got != 4*time.Second {
		t.Fatalf("Spread(3s) under a 4s ceiling = %v, want Next's 4s", got)
	}
	if got := b.Spread(20 * time.Second); got != 20*time.Second || b.Ceiling() != 16*time.Second {
		t.Fatalf("Spread(20s) = %v, ceiling %v; want 20s, 16s", got, b.Ceiling())
	}
}

func TestBackoffSpreadRandomWithinBounds(t *testing.T) {
	b := newBackoff(time.Second, 30*time.Second, nil)
	const spread = 20 * time.Second
	var below, above bool
	for range 1000 {
		b.Reset()
		d := b.Spread(spread)
		if d < 500*time.Millisecond || d > spread {
			t.Fatalf("wait %v outside [500ms, %v]", d, spread)
		}
		below = below || d < spread/2
		above = above || d > spread/2
	}
	if !below || !above {
		t.Fatalf("1000 waits all on one side of %v", spread/2)
	}
}
