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
	size int // its capacity: no frame moved through it is larger
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
	p.size = got
	return p, nil
}

func (p *kernelPipe) close() {
	unix.Close(p.r)
	unix.Close(p.w)
}

// fill moves up to max bytes from socket src into the empty pipe, waiting
// (on Go's poller, with src's read deadline) until the socket has some. It
// returns 0 and io.EOF at the socket's end.
func (p *kernelPipe) fill(src syscall.RawConn, max int) (int, error) {
	var n int64
	var serr error
	err := src.Read(func(fd uintptr) bool {
		for {
			n, serr = unix.Splice(int(fd), nil, p.w, nil, max, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			if serr != unix.EINTR {
				break
			}
		}
		// The pipe is empty, so EAGAIN can only mean the socket has
		// nothing yet: wait for it to be readable.
		return serr != unix.EAGAIN
	})
	switch {
	case err != nil:
		return 0, err
	case serr != nil:
		return 0, fmt.Errorf("splice from socket: %w", serr)
	case n == 0:
		return 0, io.EOF
	}
	return int(n), nil
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

// read copies the n bytes the pipe holds into b (len n): the way out for a
// frame that cannot be spliced after all.
func (p *kernelPipe) read(b []byte) error {
	for len(b) > 0 {
		k, err := unix.Read(p.r, b)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return fmt.Errorf("read pipe: %w", err)
		case k == 0:
			return io.ErrUnexpectedEOF
		}
		b = b[k:]
	}
	return nil
}
