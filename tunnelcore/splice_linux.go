package tunnelcore

import (
	"fmt"
	"io"
	"syscall"

	"golang.org/x/sys/unix"
)

const spliceSupported = true

// kernelPipe is a pipe a DATA payload waits in between its two splices. It
// is empty between frames.
type kernelPipe struct {
	r, w int
}

// newKernelPipe makes a non-blocking pipe of size bytes (the kernel may
// round it up). A pipe that cannot be grown past the default 64 KiB is
// not worth its descriptors: the caller copies instead.
func newKernelPipe(size int) (*kernelPipe, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("pipe: %w", err)
	}
	p := &kernelPipe{r: fds[0], w: fds[1]}
	got, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, size)
	if err != nil || got < size {
		p.close()
		return nil, fmt.Errorf("pipe of %d bytes: got %d: %v", size, got, err)
	}
	return p, nil
}

// close closes both ends, once.
func (p *kernelPipe) close() {
	if p.r < 0 {
		return
	}
	unix.Close(p.r)
	unix.Close(p.w)
	p.r, p.w = -1, -1
}

// fillPipe waits until socket src has bytes (on Go's poller, with src's
// read deadline) and moves up to max of them into a pipe from the pool,
// which it returns: a connection holds no pipe while it waits. It returns
// io.EOF at the socket's end, and errSpliceOff when there is no pipe to be
// had or the socket is at urgent data.
func fillPipe(src syscall.RawConn, max int) (*kernelPipe, int, error) {
	var p *kernelPipe
	var n int64
	var serr error
	err := src.Read(func(fd uintptr) bool {
		if p == nil {
			if p = pipes.get(); p == nil {
				serr = errSpliceOff
				return true
			}
		}
		for {
			n, serr = unix.Splice(int(fd), nil, p.w, nil, max, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			if serr != unix.EINTR {
				break
			}
		}
		if (serr == unix.EAGAIN || (serr == nil && n == 0)) && atUrgentMark(fd) {
			// splice(2) stops at urgent data: EAGAIN with bytes behind
			// it, or 0 once the FIN came. read(2) steps over it.
			serr = errSpliceOff
			return true
		}
		if serr == unix.EAGAIN {
			// Nothing yet (the pipe is empty, so it is not full): wait
			// for the socket without holding the pipe.
			pipes.put(p, true)
			p = nil
			return false
		}
		return true
	})
	switch {
	case err == nil && serr == nil && n > 0:
		return p, int(n), nil
	case p != nil:
		pipes.put(p, true) // empty: nothing was moved
	}
	switch {
	case err != nil:
		return nil, 0, err
	case serr == errSpliceOff:
		return nil, 0, serr
	case serr != nil:
		return nil, 0, fmt.Errorf("splice from socket: %w", serr)
	}
	return nil, 0, io.EOF
}

// atUrgentMark reports whether socket fd's next byte is urgent data.
func atUrgentMark(fd uintptr) bool {
	at, err := unix.IoctlGetInt(int(fd), unix.SIOCATMARK)
	return err == nil && at != 0
}

// drain moves exactly n bytes from the pipe into socket dst, waiting (on
// Go's poller) while the socket's send buffer is full.
func (p *kernelPipe) drain(dst syscall.RawConn, n int) error {
	var serr error
	err := dst.Write(func(fd uintptr) bool {
		for n > 0 {
			k, err := unix.Splice(p.r, nil, int(fd), nil, n, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // the socket is full: wait until writable
			case err != nil:
				serr = err
				return true
			case k == 0:
				serr = io.ErrUnexpectedEOF // cannot happen: the pipe holds n
				return true
			}
			n -= int(k)
		}
		return true
	})
	if err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("splice into socket: %w", serr)
	}
	return nil
}
