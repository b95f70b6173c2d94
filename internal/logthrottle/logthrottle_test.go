package logthrottle

import (
	"testing"
	"time"
)

func TestThrottleAllowsBurstThenCountsSuppressed(t *testing.T) {
	th := New(time.Hour, 3)
	for i := 0; i < 3; i++ {
		if ok, _ := th.Allow(); !ok {
			t.Fatalf("event %d of the burst refused", i)
		}
	}
	for i := 0; i < 5; i++ {
		if ok, _ := th.Allow(); ok {
			t.Fatal("event past the burst allowed")
		}
	}
	th.start = th.start.Add(-2 * time.Hour) // the period is over
	ok, suppressed := th.Allow()
	if !ok || suppressed != 5 {
		t.Fatalf("after the period: ok %v, suppressed %d, want true, 5", ok, suppressed)
	}
}

func TestZeroValueAllowsOnePerSecond(t *testing.T) {
	var th Throttle
	if ok, _ := th.Allow(); !ok {
		t.Fatal("first event refused")
	}
	if ok, _ := th.Allow(); ok {
		t.Fatal("second event within the second allowed")
	}
}
