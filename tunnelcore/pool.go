package tunnelcore

import (
	"sync"

	"google.golang.org/grpc/mem"
)

// GRPCBufferSize is the read and write buffer size for the gRPC
// connections that carry tunnels (grpc.ReadBufferSize/WriteBufferSize and
// their dial options). gRPC's 32 KiB default costs a syscall per 32 KiB;
// a few times that moves the same bytes with fewer syscalls, while 1 MiB
// buffers are slower again (BenchmarkStream, WB=...).
const GRPCBufferSize = 128 << 10

// GRPCWindowSize is the static HTTP/2 stream and connection window of the
// gRPC connections that carry tunnels (grpc.InitialWindowSize and
// InitialConnWindowSize, and their dial options), which turns off gRPC's
// BDP estimation. On a low-latency link the estimator keeps the window near
// its 64 KiB start, so the receiver sends a WINDOW_UPDATE every 16 KiB, and
// it sends a BDP ping for every small message it receives (each of our
// WindowUpdate frames drew one): both cost CPU on both sides for nothing
// a static window does not give (bench/http.sh). 16 MiB is the estimator's own ceiling, so the memory a session can
// hold in gRPC's buffers is what BDP could reach, and a WAN link gets the
// full window from the first byte instead of after the ramp. What one
// virtual connection may have in flight stays bounded by its credit window.
const GRPCWindowSize = 16 << 20

// poolTiers are the buffer sizes the pool keeps: gRPC's 16 KiB frame reads,
// io.Copy's 32 KiB, a full DATA frame and the larger message reads.
var poolTiers = [...]int{4 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20}

// dirtyPool is a mem.BufferPool that does not zero buffers it hands out.
// gRPC's default pool clears every buffer on Get, a second pass over
// every byte that dominates the cost of the in-memory data path; every
// user of this pool overwrites the bytes it exposes.
type dirtyPool struct {
	tiers [len(poolTiers)]sync.Pool
}

var bufferPool = newDirtyPool()

func newDirtyPool() *dirtyPool {
	p := &dirtyPool{}
	for i, size := range poolTiers {
		p.tiers[i].New = func() any {
			b := make([]byte, size)
			return &b
		}
	}
	return p
}

// BufferPool returns the pool sessions take DATA buffers from. Pass it to
// gRPC (experimental.WithBufferPool / experimental.BufferPool) on the
// tunnel's connections so received frames come from it too.
func BufferPool() mem.BufferPool { return bufferPool }

func (p *dirtyPool) tier(size int) int {
	for i, t := range poolTiers {
		if size <= t {
			return i
		}
	}
	return -1
}

// Get implements mem.BufferPool.
func (p *dirtyPool) Get(size int) *[]byte {
	i := p.tier(size)
	if i < 0 {
		b := make([]byte, size)
		return &b
	}
	bp := p.tiers[i].Get().(*[]byte)
	*bp = (*bp)[:size]
	return bp
}

// Put implements mem.BufferPool.
func (p *dirtyPool) Put(bp *[]byte) {
	c := cap(*bp)
	for i := len(poolTiers) - 1; i >= 0; i-- {
		if c == poolTiers[i] {
			*bp = (*bp)[:c]
			p.tiers[i].Put(bp)
			return
		}
	}
}

// bufferSize is the capacity of the buffer the pool hands out for n bytes.
func bufferSize(n int) int {
	if i := bufferPool.tier(n); i >= 0 {
		return poolTiers[i]
	}
	return n
}

// fitRoom cuts a frame of n bytes so that the buffer holding it (its
// frameCharge) fits in room bytes of queue allowance: n itself when it
// does, else the largest pool tier room holds. A frame below the smallest
// tier is not cut: it is charged minFrameCharge whatever its size.
func fitRoom(n, room int64) int64 {
	if frameCharge(n) <= room || n <= minFrameCharge {
		return n
	}
	fit := int64(minFrameCharge)
	for _, t := range poolTiers {
		if int64(t) <= room {
			fit = int64(t)
		}
	}
	return min(n, fit)
}

// fitBuffer returns a pool buffer of n's own tier holding the first n bytes
// of buf. A read that filled a small part of a large buffer is copied into a
// buffer of its size, and the large one goes back to the pool: a connection
// trickling small reads (an interactive protocol, or a client sending a
// byte at a time) would otherwise queue a 256 KiB buffer per frame, and
// frameCharge would count it at its length.
func fitBuffer(buf *[]byte, n int) *[]byte {
	if bufferSize(n) >= cap(*buf) {
		*buf = (*buf)[:n]
		return buf
	}
	fit := bufferPool.Get(n)
	copy(*fit, (*buf)[:n])
	bufferPool.Put(buf)
	return fit
}
