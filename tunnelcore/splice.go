package tunnelcore

import (
	"errors"
	"net"
	"sync"
	"syscall"
)

// Splicing. A virtual connection relaying a TCP socket onto a plaintext
// data lane (the agent's side of a download: upstream socket → lane
// socket) moves each DATA payload inside the kernel: splice(2) from the
// source socket into a pipe, then, in the connection's turn at the
// session's sender, the frame's header written to the lane and splice(2)
// from the pipe into the lane's socket. The bytes are never copied into
// the process and out again: for an agent relaying a download, the copy
// into the lane's socket, from buffers that have left the CPU cache by
// then, is the largest single cost. The wire is unchanged: the peer reads the same frames. TLS lanes
// and other sources keep the copying path.
//
// A pipe frame is queued, charged and dropped as a buffer frame is (its
// queue charge, the connection's round-robin turn, its place before the
// FIN); only the sender writes it. The relaying goroutine waits for that
// before it fills the pipe again, so each connection has one frame in its
// pipe at a time.

// spliceAbove is the read that moves a connection onto splicing: one that
// filled this much is bulk, where the pipe pays for its two descriptors
// and the extra system call per frame. Interactive connections never take
// a pipe, and a connection holds one only while its socket has bytes: it
// gives it back before waiting for more.
const spliceAbove = 64 << 10

// splicedFrame is the payload of a DATA frame waiting in a pipe
// (tunnelpb.Envelope.Deferred): n bytes in pipe. The sender reports on
// done (buffered, one report per frame) nil once it moved them into the
// stream, else why not: the pipe may then still hold them.
type splicedFrame struct {
	pipe *kernelPipe
	n    int
	done chan error
}

// Len implements tunnelpb.Deferred.
func (f *splicedFrame) Len() int { return f.n }

var (
	// errFrameDropped is a spliced frame's report when it was dropped
	// unsent (its connection aborted, or the session ended).
	errFrameDropped = errors.New("tunnel: spliced frame dropped")
	// errSpliceOff ends splicing for a connection, which goes on copying:
	// no pipe to be had, or urgent data in the socket (which splice(2)
	// stops at and read(2) steps over).
	errSpliceOff = errors.New("tunnel: splicing off")
)

// splicingStream is a stream that can write a DATA frame whose payload
// waits in a kernel pipe (ConnStream over a bare TCP socket, on Linux).
type splicingStream interface {
	// canSplice reports whether sendSpliced works on this stream.
	canSplice() bool
	// sendSpliced writes the header of connID's DATA frame of n bytes
	// after whatever Send holds, then moves the n bytes from p into the
	// stream. The sender calls it as it calls Send.
	sendSpliced(connID uint64, p *kernelPipe, n int) error
}

// pipePool keeps a few idle pipes and bounds how many exist: each is two
// descriptors, and past maxPipes a bulk connection keeps copying.
type pipePool struct {
	mu    sync.Mutex
	idle  []*kernelPipe
	inUse int
}

// The bounds keep the pipes' memory, which Linux counts per user
// (fs.pipe-user-pages-soft, 64 MiB by default), at 32 MiB.
const (
	maxPipes     = 128
	maxIdlePipes = 8
	// pipeSize is the capacity asked for each pipe: the default
	// MaxFrameSize, so that a frame takes one splice each way.
	pipeSize = DefaultMaxFrameSize
)

// pipes is the process's pipe pool, shared by every session as bufferPool
// is.
var pipes pipePool

// get returns an empty pipe, or nil when there are maxPipes already or
// the system gives no pipe of useful size (its per-user pipe memory is
// spent, say).
func (pp *pipePool) get() *kernelPipe {
	pp.mu.Lock()
	if n := len(pp.idle); n > 0 {
		p := pp.idle[n-1]
		pp.idle = pp.idle[:n-1]
		pp.inUse++
		pp.mu.Unlock()
		return p
	}
	if pp.inUse >= maxPipes {
		pp.mu.Unlock()
		return nil
	}
	pp.inUse++
	pp.mu.Unlock()
	p, err := newKernelPipe(pipeSize)
	if err != nil {
		pp.release()
		return nil
	}
	return p
}

// put takes back a pipe; one that may still hold bytes (empty false) is
// closed instead of kept.
func (pp *pipePool) put(p *kernelPipe, empty bool) {
	pp.mu.Lock()
	pp.inUse--
	if empty && len(pp.idle) < maxIdlePipes {
		pp.idle = append(pp.idle, p)
		pp.mu.Unlock()
		return
	}
	pp.mu.Unlock()
	p.close()
}

func (pp *pipePool) release() {
	pp.mu.Lock()
	pp.inUse--
	pp.mu.Unlock()
}

// spliceSource returns the raw descriptor of r when splicing from it is
// possible: a TCP socket, read by nothing else that could hold bytes back.
func spliceSource(r any) syscall.RawConn {
	tc, ok := r.(*net.TCPConn)
	if !ok || !spliceSupported {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// spliceFrom is ReadFrom's loop for a bulk connection from a TCP socket:
// each frame's payload goes through a pipe, which the sender drains into
// the lane in the connection's turn. It returns io.EOF at the socket's
// end and errSpliceOff when the connection is to go on copying.
func (c *Conn) spliceFrom(src syscall.RawConn) (total int64, err error) {
	f := &splicedFrame{done: make(chan error, 1)}
	for {
		n, err := c.reserve(min(c.s.cfg.MaxFrameSize, pipeSize))
		if err != nil {
			return total, err
		}
		p, m, err := fillPipe(src, n)
		if m < n {
			c.unreserve(int64(n), int64(m))
		}
		if err != nil {
			return total, err
		}
		f.pipe, f.n = p, m
		if !c.s.sendSpliced(c, f) {
			pipes.put(p, false)
			return total, c.dataRefused(int64(m))
		}
		if err := <-f.done; err != nil {
			pipes.put(p, false) // it may still hold the payload
			return total, c.dataRefused(int64(m))
		}
		pipes.put(p, true)
		c.countMoved(true, int64(m))
		c.s.spliced.Add(int64(m))
		total += int64(m)
	}
}
