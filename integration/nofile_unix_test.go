//go:build unix

package integration

import (
	"syscall"
	"testing"
)

// raiseNoFile raises the soft open-file limit to the hard limit (Go
// already does at start on Linux; this keeps the test honest elsewhere) and
// skips when even that is below need.
func raiseNoFile(t testing.TB, need uint64) {
	t.Helper()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Logf("raising RLIMIT_NOFILE: %v", err)
		}
		syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	if uint64(lim.Cur) < need { // int64 on some BSDs
		t.Skipf("open-file limit %d below the %d this test needs", lim.Cur, need)
	}
}
