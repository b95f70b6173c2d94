package tunnelcore

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// ConnStream runs a session's frames straight over a byte stream (a TCP or
// TLS connection, the data lane of proto/README §2.4) instead of a gRPC
// stream. Each frame is written exactly as gRPC frames a message: one byte
// 0 (not compressed), its length as 4 bytes big-endian, then the Frame in
// protobuf wire format, so the lane carries the bytes a gRPC stream's DATA
// frames would, without HTTP/2 around them.
//
// What it saves over gRPC, per direction: the sender writes each message
// with one writev of its header and the payload buffers (gRPC copies every
// 16 KiB frame into its write buffer, on its own writer goroutine), and the
// receiver reads up to 256 KiB at a time into pool buffers and hands out
// views of them (gRPC copies every 16 KiB frame out of its read buffer, on
// its own reader goroutine). Flow control is the kernel's: Send blocks while
// the socket's send buffer is full, which stops the session's sender as
// gRPC's window would, and every virtual connection keeps its credit window.
//
// Send is called from one goroutine and Recv from another, as FrameStream
// says. Close closes conn, which ends both.
func ConnStream(conn net.Conn) LaneStream {
	s := &connStream{conn: conn, rd: laneReader{r: conn, raw: readyReads(conn)}, recvEnded: make(chan struct{})}
	tc, ok := conn.(*net.TCPConn)
	if !ok {
		// A bare TCP socket writes net.Buffers with one writev; anything
		// else (TLS) would write the 5-byte header on its own, a record
		// and a syscall of its own.
		s.bw = bufio.NewWriterSize(conn, laneWriteBuffer)
	} else if spliceSupported {
		s.raw, _ = tc.SyscallConn()
	}
	return s
}

// laneWriteBuffer is the write buffer of a lane that is not a bare socket.
const laneWriteBuffer = 32 << 10

// LaneStream is the FrameStream ConnStream returns. A wrapper must keep
// Flush: the session's sender flushes a stream that has it. Its unexported
// methods (splicing) mean only ConnStream implements it: a wrapper embeds
// it, and whatever it overrides of Send does not see spliced frames.
type LaneStream interface {
	FrameStream
	Flush() error
	Holding() bool
	CloseWrite() error
	PeerEnded() bool
	RecvEnded() <-chan struct{}
	splicingStream
}

// OverSocket marks conn (a TLS conn, or gRPC credentials' wrapper of one,
// which hides the TLS conn's NetConn) as running over the TCP socket raw:
// a ConnStream half-closes and closes raw directly (a TLS close_notify
// waits up to 5 s on a peer that stopped reading) and reads the stall
// watchdog's progress from it.
//
// A conn that is raw itself (plaintext) is returned as it is: ConnStream
// writes a bare TCP socket with writev, anything else through a buffer.
func OverSocket(conn, raw net.Conn) net.Conn {
	if conn == raw {
		return conn
	}
	return &socketConn{Conn: conn, raw: raw}
}

type socketConn struct {
	net.Conn
	raw net.Conn
}

// NetConn returns the socket (tcpConnOf looks through it).
func (c *socketConn) NetConn() net.Conn { return c.raw }

// maxLaneMessage bounds a message on the lane as gRPC's default receive
// limit bounds one on the stream: a larger length is a broken peer.
const maxLaneMessage = 4 << 20

// laneChunk is the size of the pool buffers the lane reads into, and
// minLaneRead the least room a chunk must have left for the next read when
// nothing in it is pending: a new chunk is taken instead, so reads stay
// large.
const (
	laneChunk   = 256 << 10
	minLaneRead = 16 << 10
)

// ErrLaneMessageTooLarge is returned by Recv for a length prefix over
// maxLaneMessage, and ErrLaneCompressed for a compressed message (a sluice
// peer never sends one).
var (
	ErrLaneMessageTooLarge = errors.New("sluice lane: message too large")
	ErrLaneCompressed      = errors.New("sluice lane: compressed message")
)

type connStream struct {
	conn net.Conn

	// Send's state (the sender goroutine's): frames written but not yet
	// flushed, as one writev's buffers, and the payloads they hold.
	pending net.Buffers
	hdrs    []byte // the pending frames' headers, 5 bytes each
	held    []mem.BufferSlice
	size    int
	bw      *bufio.Writer   // nil on a bare socket
	raw     syscall.RawConn // the bare socket's, where splice works; else nil

	rd laneReader

	closing   atomic.Bool   // Close was called
	peerEnded atomic.Bool   // Recv failed before Close: the peer ended the lane
	recvEnded chan struct{} // closed when Recv failed
	endOnce   sync.Once
	closeOnce sync.Once
}

// laneBatch is how much Send holds before it writes: frames queued
// together (grants, small responses of many connections) leave in one
// writev, as gRPC's writer puts many frames in one write; the sender
// flushes whenever its queue runs empty. A larger frame is written at once.
const laneBatch = 64 << 10

// Send implements FrameStream. It may hold the frame until Flush (see
// laneBatch).
func (s *connStream) Send(e *tunnelpb.Envelope) error {
	data, err := tunnelpb.Codec{}.Marshal(e)
	if err != nil {
		return err
	}
	n := data.Len()
	if n > maxLaneMessage {
		data.Free()
		return fmt.Errorf("%w: %d bytes", ErrLaneMessageTooLarge, n)
	}
	hdr := s.header(n, 0, 0)
	if s.bw != nil {
		s.bw.Write(hdr)
		for _, b := range data {
			s.bw.Write(b.ReadOnlyData())
		}
		data.Free()
		s.hdrs = s.hdrs[:0]
		return nil // bufio writes what fills it; Flush the rest
	}
	s.pending = append(s.pending, hdr)
	for _, b := range data {
		s.pending = append(s.pending, b.ReadOnlyData())
	}
	s.held = append(s.held, data)
	s.size += 5 + n
	if s.size >= laneBatch || len(s.pending) >= maxLaneIovecs {
		return s.Flush()
	}
	return nil
}

// header appends to hdrs the 5-byte lane header of a message of n bytes
// and returns it; with connID set (n then the payload's length), followed
// by the DATA frame's bytes that come before the payload, and the length
// counts them too.
func (s *connStream) header(n int, connID uint64, payload int) []byte {
	if cap(s.hdrs)-len(s.hdrs) < 5+tunnelpb.MaxDataHeader {
		// The pending buffers point into the old array, which stays.
		s.hdrs = make([]byte, 0, 64*(5+tunnelpb.MaxDataHeader))
	}
	start := len(s.hdrs)
	s.hdrs = append(s.hdrs, 0, 0, 0, 0, 0)
	if connID != 0 || payload != 0 {
		s.hdrs = tunnelpb.AppendDataHeader(s.hdrs, connID, payload)
		n = len(s.hdrs) - start - 5 + payload
	}
	binary.BigEndian.PutUint32(s.hdrs[start+1:], uint32(n))
	return s.hdrs[start:]
}

// maxLaneIovecs keeps a writev within Linux's 1024 buffers.
const maxLaneIovecs = 512

// canSplice implements splicingStream: a plaintext lane on Linux.
func (s *connStream) canSplice() bool { return s.raw != nil }

// sendSpliced implements splicingStream: the frame's lane header and DATA
// header go out with whatever Send still holds, in one writev, then the
// payload moves from the pipe into the socket.
func (s *connStream) sendSpliced(connID uint64, p *kernelPipe, n int) error {
	if n > maxLaneMessage-tunnelpb.MaxDataHeader {
		return fmt.Errorf("%w: %d bytes", ErrLaneMessageTooLarge, n)
	}
	s.pending = append(s.pending, s.header(0, connID, n))
	if err := s.Flush(); err != nil {
		return err
	}
	return p.drain(s.raw, n)
}

// Holding reports whether Send holds a few small frames (under
// laneYieldBelow bytes together) that Flush would write: the requests and
// answers of interactive connections and window grants, which others
// queued a moment later could join. Bulk data is not held back for them.
func (s *connStream) Holding() bool {
	n := s.size
	if s.bw != nil {
		n = s.bw.Buffered()
	}
	return n > 0 && n < laneYieldBelow
}

// laneYieldBelow: see Holding.
const laneYieldBelow = 16 << 10

// Flush writes the frames Send holds.
func (s *connStream) Flush() error {
	if s.bw != nil {
		return s.bw.Flush()
	}
	if len(s.pending) == 0 {
		return nil
	}
	w := s.pending // WriteTo consumes the slice it is given
	_, err := w.WriteTo(s.conn)
	clear(s.pending) // drop references to buffers going back to the pool
	s.pending = s.pending[:0]
	for i, d := range s.held {
		d.Free()
		s.held[i] = nil
	}
	s.held = s.held[:0]
	s.hdrs = s.hdrs[:0]
	s.size = 0
	return err
}

// Recv implements FrameStream.
func (s *connStream) Recv(e *tunnelpb.Envelope) error {
	data, err := s.rd.next()
	if err != nil {
		if !s.closing.Load() {
			s.peerEnded.Store(true)
		}
		s.endOnce.Do(func() { close(s.recvEnded) })
		return err
	}
	err = tunnelpb.Codec{}.Unmarshal(data, e)
	data.Free()
	return err
}

// Close implements FrameStream. The frames Send still holds are dropped,
// as a gRPC stream drops what it has queued when it is cancelled. Over a
// known TCP socket (OverSocket, or TLS's NetConn) the socket is closed
// directly: a TLS close_notify would wait on a peer that stopped reading.
func (s *connStream) Close(error) {
	s.closeOnce.Do(func() {
		s.closing.Store(true)
		if tc := tcpConnOf(s.conn); tc != nil {
			tc.Close()
			return
		}
		s.conn.SetWriteDeadline(time.Now())
		s.conn.Close()
	})
}

// CloseWrite ends what this end sends after the frames already flushed
// (TCP FIN on the socket) and leaves the reading side open, so that the
// peer reads everything before its end of the lane; Close must follow.
func (s *connStream) CloseWrite() error {
	if tc := tcpConnOf(s.conn); tc != nil {
		return tc.CloseWrite()
	}
	if cw, ok := s.conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// RecvEnded is closed once Recv failed (the peer closed the lane, or it
// broke, or Close).
func (s *connStream) RecvEnded() <-chan struct{} { return s.recvEnded }

// PeerEnded reports whether Recv failed before Close: the peer closed or
// broke the lane.
func (s *connStream) PeerEnded() bool { return s.peerEnded.Load() }

// laneReader splits a byte stream into length-prefixed messages without
// copying their bytes: it reads into a pool chunk and returns views of it,
// which hold the chunk until the last one is freed. A message longer than
// what is left of the chunk is completed by one read straight into a pool
// buffer of its remaining size, so large DATA messages cost no copy and few
// syscalls.
type laneReader struct {
	r     io.Reader
	raw   syscall.RawConn // r's socket when it is a bare TCP one (readReady); nil: read r
	chunk mem.Buffer      // our reference to the current chunk, nil if none
	buf   []byte          // chunk's bytes; [rd, wr) are read and not yet handed out
	rd    int
	wr    int
}

// next returns the next message; the caller frees it.
func (l *laneReader) next() (mem.BufferSlice, error) {
	if err := l.fill(5); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) && l.rd == l.wr {
			return nil, io.EOF // between messages: a clean end
		}
		return nil, err
	}
	hdr := l.buf[l.rd : l.rd+5]
	if hdr[0] != 0 {
		return nil, ErrLaneCompressed
	}
	n := int(binary.BigEndian.Uint32(hdr[1:]))
	if n > maxLaneMessage {
		return nil, fmt.Errorf("%w: %d bytes", ErrLaneMessageTooLarge, n)
	}
	l.rd += 5
	if n == 0 {
		return nil, nil
	}
	if l.rd+n <= len(l.buf) {
		if err := l.fill(n); err != nil {
			return nil, err
		}
		msg := mem.BufferSlice{l.view(l.rd, l.rd+n)}
		l.rd += n
		return msg, nil
	}
	// The message runs past the chunk: take what is here, read the rest
	// into buffers of its own.
	var msg mem.BufferSlice
	if have := l.wr - l.rd; have > 0 {
		msg = append(msg, l.view(l.rd, l.wr))
		n -= have
	}
	l.dropChunk()
	msg, err := l.readRest(msg, n)
	if err != nil {
		msg.Free()
		return nil, err
	}
	return msg, nil
}

// firstRestPiece is the size of the first buffer readRest takes: the
// chunk's size, so that the rest of a DATA message of the default largest
// frame (DefaultMaxFrameSize) is still one buffer and one read.
const firstRestPiece = laneChunk

// readRest appends the next n bytes of the stream to msg, in buffers read
// whole, each twice the size of the one before (from firstRestPiece, at
// most n in all). Memory is taken as the bytes arrive, not as announced:
// a peer that announces a 4 MiB message and sends 5 bytes holds 256 KiB of
// the node's memory besides the chunk, not 4 MiB (gRPC likewise assembles
// a message from the HTTP/2 frames that arrived).
func (l *laneReader) readRest(msg mem.BufferSlice, n int) (mem.BufferSlice, error) {
	for piece := firstRestPiece; n > 0; piece *= 2 {
		size := min(piece, n)
		if n-size < size/2 {
			size = n // no small last piece
		}
		buf := bufferPool.Get(size)
		if _, err := io.ReadFull(l.r, *buf); err != nil {
			bufferPool.Put(buf)
			return msg, unexpected(err)
		}
		msg = append(msg, mem.NewBuffer(buf, bufferPool))
		n -= size
	}
	return msg, nil
}

// view returns chunk bytes [from, to): a view that holds the chunk, or
// for fewer than minLaneView bytes a copy. A view of a few bytes would keep
// the whole 256 KiB chunk while a connection's reader leaves them unread,
// so received bytes could hold far more memory than the windows that
// bound them; with the copies, at most laneChunk/minLaneView times as much.
func (l *laneReader) view(from, to int) mem.Buffer {
	if to-from < minLaneView {
		return mem.Copy(l.buf[from:to], bufferPool)
	}
	return l.chunk.Slice(from, to)
}

// minLaneView: see view.
const minLaneView = laneChunk / 4

// fill makes at least n bytes from rd available in the chunk, taking a new
// chunk (and moving the few unread bytes into it) when the current one has
// no room for them.
func (l *laneReader) fill(n int) error {
	// On a bare socket, readReady takes the chunk when there are bytes
	// for it.
	if (l.chunk == nil && l.raw == nil) || (l.chunk != nil && (l.rd+n > len(l.buf) || (l.rd == l.wr && len(l.buf)-l.wr < minLaneRead))) {
		l.newChunk()
	}
	for l.wr-l.rd < n {
		m, err := l.read()
		l.wr += m
		if err != nil && l.wr-l.rd < n {
			return unexpected(err)
		}
	}
	return nil
}

// read reads once into the chunk: on a bare socket when it is readable
// (readReady, which takes the chunk if fill dropped it), else from r.
func (l *laneReader) read() (int, error) {
	if l.raw != nil {
		return l.readReady()
	}
	return l.r.Read(l.buf[l.wr:])
}

// newChunk replaces the current chunk with a fresh one, moving the bytes
// read but not yet handed out (at most a message header: fill asks for a
// new chunk only when they do not fit).
func (l *laneReader) newChunk() {
	bp := bufferPool.Get(laneChunk)
	left := copy(*bp, l.buf[l.rd:l.wr])
	l.dropChunk()
	l.chunk = mem.NewBuffer(bp, bufferPool)
	l.buf = *bp
	l.rd, l.wr = 0, left
}

func (l *laneReader) dropChunk() {
	if l.chunk != nil {
		l.chunk.Free()
	}
	l.chunk, l.buf, l.rd, l.wr = nil, nil, 0, 0
}

// unexpected turns an end of the stream inside a message into
// io.ErrUnexpectedEOF.
func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// ConnProgress reads the bytes the peer acknowledged on conn's socket, for
// Config.Progress of a session on a ConnStream; nil when conn is not TCP
// underneath (looking through NetConn, as of a TLS conn or OverSocket) or
// the platform has no TCP_INFO.
func ConnProgress(conn net.Conn) func() uint64 { return socketProgress(conn) }
