package tunnelpb

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// FuzzUnmarshalEnvelope: whatever bytes a peer sends, the codec does not
// panic, and what it reads agrees with protobuf's reading of the same bytes:
// a DATA frame's id and payload, or the same Frame, or an error where
// protobuf has one. The bytes arrive split into buffers at an arbitrary
// point, as gRPC hands them over.
func FuzzUnmarshalEnvelope(f *testing.F) {
	for _, e := range []*Envelope{
		{ConnID: 2, Payload: mem.BufferSlice{mem.SliceBuffer([]byte("hello"))}},
		{ConnID: 0},
		{ConnID: 1 << 40, Payload: mem.BufferSlice{mem.SliceBuffer(bytes.Repeat([]byte{7}, 300))}},
		{Frame: &Frame{Kind: &Frame_Connect{Connect: &Connect{ConnId: 4, RouteKey: "app", ServerName: "a.test", Window: 65536}}}},
		{Frame: &Frame{Kind: &Frame_Data{Data: &Data{ConnId: 3}}}},
	} {
		b, err := Codec{}.Marshal(e)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b.Materialize(), 3)
	}
	f.Add([]byte{0x22, 0xff, 0xff, 0xff, 0xff, 0x0f}, 1) // a DATA length past the end
	f.Add([]byte{0x22, 0x03, 0x12, 0x80, 0x80}, 2)       // a payload length past the end
	f.Fuzz(func(t *testing.T, data []byte, split int) {
		if split < 0 || split > len(data) {
			split = len(data) / 2
		}
		in := mem.BufferSlice{mem.SliceBuffer(data[:split]), mem.SliceBuffer(data[split:])}
		var e Envelope
		err := Codec{}.Unmarshal(in, &e)
		var want Frame
		werr := proto.Unmarshal(data, &want)
		if err != nil {
			if werr == nil {
				t.Fatalf("codec error %v where protobuf reads %v", err, &want)
			}
			return
		}
		if werr != nil {
			// The fast path takes well-formed DATA frames only, which
			// protobuf reads too.
			t.Fatalf("codec read %+v where protobuf fails: %v", e, werr)
		}
		if !e.IsData() {
			if !proto.Equal(e.Frame, &want) {
				t.Fatalf("codec read %v, protobuf %v", e.Frame, &want)
			}
			return
		}
		d := want.GetData()
		if d == nil {
			t.Fatalf("codec read DATA, protobuf %v", &want)
		}
		if e.ConnID != d.GetConnId() || !bytes.Equal(e.Payload.Materialize(), d.GetPayload()) {
			t.Fatalf("codec read DATA %d %q, protobuf %d %q", e.ConnID, e.Payload.Materialize(), d.GetConnId(), d.GetPayload())
		}
	})
}
