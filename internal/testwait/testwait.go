// Package testwait is the one way tests in this repository wait for a
// condition: poll it with a deadline, never sleep for a guessed time.
package testwait

import (
	"testing"
	"time"
)

// pollEvery is short next to every deadline the tests use and long enough
// not to busy-loop the two cores the suite runs on.
const pollEvery = 5 * time.Millisecond

// Until polls cond until it holds, failing t (naming what it waited for)
// when within passes first.
func Until(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(pollEvery)
	}
}
