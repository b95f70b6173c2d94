//go:build !linux

package tunnelcore

import (
	"errors"
	"syscall"
)

// Splicing is Linux's (splice(2)); elsewhere every payload is copied.
const spliceSupported = false

type kernelPipe struct{}

var errNoSplice = errors.New("splice is not supported on this system")

func newKernelPipe(int) (*kernelPipe, error)                  { return nil, errNoSplice }
func (*kernelPipe) close()                                    {}
func fillPipe(syscall.RawConn, int) (*kernelPipe, int, error) { return nil, 0, errSpliceOff }
func (*kernelPipe) drain(syscall.RawConn, int) error          { return errNoSplice }
