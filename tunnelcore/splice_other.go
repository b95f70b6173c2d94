//go:build !linux

package tunnelcore

import (
	"errors"
	"syscall"
)

// Splicing is Linux's (splice(2)); elsewhere every payload is copied.
const spliceSupported = false

type kernelPipe struct{ size int }

var errNoSplice = errors.New("splice is not supported on this system")

func newKernelPipe(int) (*kernelPipe, error)               { return nil, errNoSplice }
func (*kernelPipe) close()                                 {}
func (*kernelPipe) fill(syscall.RawConn, int) (int, error) { return 0, errNoSplice }
func (*kernelPipe) drain(syscall.RawConn, int) error       { return errNoSplice }
func (*kernelPipe) read([]byte) error                      { return errNoSplice }
