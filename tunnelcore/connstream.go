package tunnelcore

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"

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
func ConnStream(conn net.Conn) FrameStream {
	s := &connStream{conn: conn, rd: laneReader{r: conn}}
	if _, ok := conn.(*net.TCPConn); !ok {
		// Only a TCP (or Unix) socket writes net.Buffers with one writev;
		// anything else (TLS) would write the 5-byte header on its own, a
		// record and a syscall of its own.
		s.bw = bufio.NewWriterSize(conn, laneWriteBuffer)
	}
	return s
}

// laneWriteBuffer is the write buffer of a lane that is not a bare socket.
const laneWriteBuffer = 32 << 10

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

	// Send's state (the sender goroutine's).
	hdr  [5]byte
	bufs net.Buffers
	bw   *bufio.Writer // nil on a bare socket

	rd laneReader

	closeOnce sync.Once
}

// Send implements FrameStream.
func (s *connStream) Send(e *tunnelpb.Envelope) error {
	data, err := tunnelpb.Codec{}.Marshal(e)
	if err != nil {
		return err
	}
	defer data.Free()
	n := data.Len()
	if n > maxLaneMessage {
		return fmt.Errorf("%w: %d bytes", ErrLaneMessageTooLarge, n)
	}
	s.hdr[0] = 0
	binary.BigEndian.PutUint32(s.hdr[1:], uint32(n))
	if s.bw != nil {
		return s.sendBuffered(data)
	}
	bufs := append(s.bufs[:0], s.hdr[:])
	for _, b := range data {
		bufs = append(bufs, b.ReadOnlyData())
	}
	// WriteTo consumes the slice it is given; keep the backing array.
	s.bufs = bufs
	w := bufs
	_, err = w.WriteTo(s.conn)
	clear(bufs) // drop references to buffers going back to the pool
	return err
}

func (s *connStream) sendBuffered(data mem.BufferSlice) error {
	s.bw.Write(s.hdr[:])
	for _, b := range data {
		s.bw.Write(b.ReadOnlyData())
	}
	return s.bw.Flush()
}

// Recv implements FrameStream.
func (s *connStream) Recv(e *tunnelpb.Envelope) error {
	data, err := s.rd.next()
	if err != nil {
		return err
	}
	err = tunnelpb.Codec{}.Unmarshal(data, e)
	data.Free()
	return err
}

// Close implements FrameStream.
func (s *connStream) Close(error) {
	s.closeOnce.Do(func() { s.conn.Close() })
}

// laneReader splits a byte stream into length-prefixed messages without
// copying their bytes: it reads into a pool chunk and returns views of it,
// which hold the chunk until the last one is freed. A message longer than
// what is left of the chunk is completed by one read straight into a pool
// buffer of its remaining size, so large DATA messages cost no copy and few
// syscalls.
type laneReader struct {
	r     io.Reader
	chunk mem.Buffer // our reference to the current chunk, nil if none
	buf   []byte     // chunk's bytes; [rd, wr) are read and not yet handed out
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
		msg := mem.BufferSlice{l.chunk.Slice(l.rd, l.rd+n)}
		l.rd += n
		return msg, nil
	}
	// The message runs past the chunk: take what is here, read the rest
	// into a buffer of its own.
	var msg mem.BufferSlice
	if have := l.wr - l.rd; have > 0 {
		msg = append(msg, l.chunk.Slice(l.rd, l.wr))
		n -= have
	}
	l.dropChunk()
	rest := bufferPool.Get(n)
	if _, err := io.ReadFull(l.r, *rest); err != nil {
		bufferPool.Put(rest)
		msg.Free()
		return nil, unexpected(err)
	}
	return append(msg, mem.NewBuffer(rest, bufferPool)), nil
}

// fill makes at least n bytes from rd available in the chunk, taking a new
// chunk (and moving the few unread bytes into it) when the current one has
// no room for them.
func (l *laneReader) fill(n int) error {
	if l.chunk == nil || l.rd+n > len(l.buf) || (l.rd == l.wr && len(l.buf)-l.wr < minLaneRead) {
		l.newChunk()
	}
	for l.wr-l.rd < n {
		m, err := l.r.Read(l.buf[l.wr:])
		l.wr += m
		if err != nil && l.wr-l.rd < n {
			return unexpected(err)
		}
	}
	return nil
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
// underneath or the platform has no TCP_INFO. A TLS conn is looked through
// (NetConn), and so is gRPC's wrapper of one, which exposes the socket
// under it (syscall.Conn) but not the TLS conn's NetConn.
func ConnProgress(conn net.Conn) func() uint64 {
	if p := socketProgress(conn); p != nil {
		return p
	}
	if sc, ok := conn.(syscall.Conn); ok {
		return syscallProgress(sc)
	}
	return nil
}
