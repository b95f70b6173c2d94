package tunnelcore

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// FuzzMisbehavingPeer: a peer that sends any sequence of frames (connects
// with any ids and windows, data beyond credit or for unknown ids, closes,
// errors, window updates with any values, session frames, datagram flows
// with any datagrams, too large ones included) can fail its own
// connections or the session, but never panics the session, and the
// session's goroutines end once it is closed (goleak in TestMain checks).
// Each input byte picks a frame, the next ones its fields.
func FuzzMisbehavingPeer(f *testing.F) {
	f.Add([]byte{0, 2, 1, 1, 2, 3, 2, 2, 4, 2})
	f.Add([]byte{0, 2, 1, 2, 255, 255, 6, 2, 0, 7})
	f.Add([]byte{0, 4, 0, 0, 4, 1, 1, 4, 9, 5, 4, 2, 3, 4, 7})
	f.Add([]byte{8, 3, 0, 0, 2, 1, 1, 0, 3, 1})
	f.Add([]byte{0, 5, 0, 1, 5, 1, 1, 5, 255, 4, 5, 9, 0, 2, 5, 1, 5, 3})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 512 {
			ops = ops[:512]
		}
		orig := append([]byte(nil), ops...)
		hang := time.AfterFunc(20*time.Second, func() {
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			panic(fmt.Sprintf("input %v hangs:\n%s", orig, buf[:n]))
		})
		defer hang.Stop()
		nodeEnd, peer := Pipe(1024)
		s, err := NewSession(nodeEnd, Config{Role: RoleNode, AcceptBacklog: 4, Slots: NewSlots(8)})
		if err != nil {
			t.Fatal(err)
		}
		// The application: reads what its connections get, answers, closes.
		served := make(chan struct{})
		go func() {
			defer close(served)
			for {
				c, err := s.Accept(context.Background())
				if err != nil {
					return
				}
				go func() {
					c.SetDeadline(time.Now().Add(time.Second))
					buf := make([]byte, 4096)
					n, _ := c.Read(buf)
					c.Write(buf[:n])
					c.Close()
				}()
			}
		}()
		// The peer reads and drops whatever the session sends.
		go func() {
			for {
				var e tunnelpb.Envelope
				if peer.Recv(&e) != nil {
					return
				}
				e.Payload.Free()
			}
		}()
		next := func() uint64 {
			if len(ops) == 0 {
				return 0
			}
			b := ops[0]
			ops = ops[1:]
			return uint64(b)
		}
		for len(ops) > 0 {
			var fr *tunnelpb.Frame
			switch next() % 9 {
			case 0:
				// Ids 5, 13, 21, ... open datagram flows (any window).
				id := next()
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Connect{Connect: &tunnelpb.Connect{ConnId: id, RouteKey: "r", Window: uint32(next()) << 12, Datagram: id%8 == 5}}}
			case 1:
				id, n := next(), int(next())*300
				err = peer.Send(&tunnelpb.Envelope{ConnID: id, Payload: mem.BufferSlice{mem.SliceBuffer(make([]byte, n))}})
			case 2:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: next()}}}
			case 3:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Error{Error: &tunnelpb.Error{ConnId: next(), Code: tunnelpb.Error_Code(next() % 9), Message: "x"}}}
			case 4:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{
					ConnId: next(), Increment: uint32(next()) << (next() % 32), Blocked: next()%2 == 0,
					ReclaimAbove: uint32(next()) << 10, Released: uint32(next()) << (next() % 32),
				}}}
			case 5:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{AgentId: "a"}}}
			case 6:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: uint32(next())}}}
			case 7:
				fr = &tunnelpb.Frame{Kind: &tunnelpb.Frame_Data{Data: &tunnelpb.Data{ConnId: next()}}}
			case 8:
				fr = &tunnelpb.Frame{}
			}
			if fr != nil {
				err = peer.Send(&tunnelpb.Envelope{Frame: fr})
			}
			if err != nil {
				break // the session ended the stream
			}
		}
		s.Close()
		peer.Close(io.EOF)
		select {
		case <-served:
		case <-time.After(10 * time.Second):
			t.Fatal("Accept did not return after the session closed")
		}
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the session did not end")
		}
	})
}
