//go:build !unix

package integration

import "testing"

// raiseNoFile skips where the open-file limit is not read: a test that
// needs many descriptors runs on Unix.
func raiseNoFile(t testing.TB, need uint64) {
	t.Helper()
	t.Skipf("needs %d open files; the limit is read on Unix only", need)
}
