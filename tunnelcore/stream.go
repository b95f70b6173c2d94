package tunnelcore

import (
	"errors"
	"io"
	"sync"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// FrameStream is what a Session runs on: an ordered, reliable stream of
// frames. Send is called from one goroutine and may block while the
// transport is not ready; Recv from another. Close aborts the stream and
// unblocks both.
type FrameStream interface {
	Send(*tunnelpb.Envelope) error
	Recv(*tunnelpb.Envelope) error
	Close(cause error)
}

// MsgStream is the part of grpc.ClientStream and grpc.ServerStream a
// session needs.
type MsgStream interface {
	SendMsg(m any) error
	RecvMsg(m any) error
}

// GRPCStream adapts a gRPC Connect stream whose codec is tunnelpb.Codec.
// cancel must end the stream: the client's stream context cancel func, or on
// the server a func that makes the handler return.
func GRPCStream(s MsgStream, cancel func()) FrameStream {
	return &grpcStream{s: s, cancel: cancel}
}

type grpcStream struct {
	s      MsgStream
	cancel func()
}

func (g *grpcStream) Send(e *tunnelpb.Envelope) error { return g.s.SendMsg(e) }
func (g *grpcStream) Recv(e *tunnelpb.Envelope) error { return g.s.RecvMsg(e) }
func (g *grpcStream) Close(error)                     { g.cancel() }

// Pipe returns two connected in-memory FrameStreams. Every frame goes
// through tunnelpb.Codec, as on gRPC, and each direction holds at most depth
// frames, so a receiver that stops reading stops its sender as gRPC flow
// control would.
func Pipe(depth int) (FrameStream, FrameStream) {
	ab := make(chan mem.BufferSlice, depth)
	ba := make(chan mem.BufferSlice, depth)
	shared := &pipeShared{done: make(chan struct{})}
	return &pipeEnd{out: ab, in: ba, shared: shared}, &pipeEnd{out: ba, in: ab, shared: shared}
}

// ErrPipeClosed is returned by a Pipe end after either end was closed.
var ErrPipeClosed = errors.New("frame pipe closed")

type pipeShared struct {
	once sync.Once
	done chan struct{}
}

type pipeEnd struct {
	out    chan<- mem.BufferSlice
	in     <-chan mem.BufferSlice
	shared *pipeShared
}

func (p *pipeEnd) Send(e *tunnelpb.Envelope) error {
	data, err := tunnelpb.Codec{}.Marshal(e)
	if err != nil {
		return err
	}
	select {
	case <-p.shared.done:
		data.Free()
		return ErrPipeClosed
	default:
	}
	select {
	case p.out <- data:
		return nil
	case <-p.shared.done:
		data.Free()
		return ErrPipeClosed
	}
}

// Recv returns the next frame; after Close, the frames sent before it, then
// io.EOF (as a gRPC server's messages reach the client before its status).
func (p *pipeEnd) Recv(e *tunnelpb.Envelope) error {
	var data mem.BufferSlice
	select {
	case data = <-p.in:
	case <-p.shared.done:
		select {
		case data = <-p.in:
		default:
			return io.EOF
		}
	}
	err := tunnelpb.Codec{}.Unmarshal(data, e)
	data.Free()
	return err
}

func (p *pipeEnd) Close(error) { p.shared.once.Do(func() { close(p.shared.done) }) }
