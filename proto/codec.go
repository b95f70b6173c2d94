package tunnelpb

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Envelope is the Go value the sluice codec sends and receives on the Connect
// stream. A DATA frame travels as ConnID and Payload, so its bytes never pass
// through protobuf marshalling; every other frame travels as Frame. On the wire
// both are the same protobuf Frame message, so any protobuf implementation of
// tunnel.proto interoperates.
type Envelope struct {
	// Frame is any frame but DATA. Nil when the envelope carries DATA.
	Frame *Frame
	// ConnID and Payload carry a DATA frame when Frame is nil.
	ConnID uint64
	// Payload is owned by the envelope: Marshal hands its references to
	// gRPC, which frees them once written; Unmarshal fills it with
	// references the receiver must Free.
	Payload mem.BufferSlice
	// Deferred, set by a sender instead of Payload, stands for a payload
	// that is not in memory: a stream that knows it writes the frame's
	// header (AppendDataHeader) and then moves the bytes in itself
	// (tunnelcore's splicing on a data lane). Marshal refuses it.
	Deferred Deferred
}

// Deferred is a DATA payload a stream writes itself (Envelope.Deferred).
type Deferred interface {
	// Len is the payload's length in bytes.
	Len() int
}

// IsData reports whether the envelope carries a DATA frame.
func (e *Envelope) IsData() bool { return e.Frame == nil }

// DataLen is the length of a DATA envelope's payload, deferred or not.
func (e *Envelope) DataLen() int {
	if e.Deferred != nil {
		return e.Deferred.Len()
	}
	return e.Payload.Len()
}

// CodecName is the name the codec reports. The codec is forced on the
// Connect stream with grpc.ForceServerCodecV2 / grpc.ForceCodecV2, so the
// content type stays application/grpc (protobuf) and other gRPC users in the
// process keep the stock codec.
const CodecName = "proto"

// Codec is the sluice gRPC codec: Envelopes are written in protobuf wire
// format by hand for DATA, everything else is delegated to protobuf.
type Codec struct{}

var _ encoding.CodecV2 = Codec{}

// dataFrameField is the Frame field number of Data, payloadField and
// connIDField the field numbers inside Data.
const (
	dataFrameField = 4
	connIDField    = 1
	payloadField   = 2
)

// Name implements encoding.CodecV2.
func (Codec) Name() string { return CodecName }

// Marshal implements encoding.CodecV2.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *Envelope:
		if m.Frame != nil {
			return marshalProto(m.Frame)
		}
		if m.Deferred != nil {
			return nil, errors.New("sluice codec: a deferred payload is written by its stream, not marshalled")
		}
		return marshalData(m), nil
	case proto.Message:
		return marshalProto(m)
	default:
		return nil, fmt.Errorf("sluice codec: cannot marshal %T", v)
	}
}

func marshalProto(m proto.Message) (mem.BufferSlice, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

// marshalData writes the Frame{data: Data{conn_id, payload}} header and hands
// the payload buffers to gRPC without copying them.
func marshalData(e *Envelope) mem.BufferSlice {
	hdr := AppendDataHeader(make([]byte, 0, MaxDataHeader), e.ConnID, e.Payload.Len())
	out := make(mem.BufferSlice, 0, 1+len(e.Payload))
	out = append(out, mem.SliceBuffer(hdr))
	out = append(out, e.Payload...)
	e.Payload = nil // ownership moved to gRPC
	return out
}

// MaxDataHeader is room enough for what AppendDataHeader appends for any
// payload under 256 MiB (21 bytes at most).
const MaxDataHeader = 32

// AppendDataHeader appends the protobuf bytes of a DATA frame of connID that
// come before its plen payload bytes: a frame is these bytes followed by
// the payload, which lets a sender write the payload from elsewhere (a
// kernel pipe) without building the frame in memory.
func AppendDataHeader(dst []byte, connID uint64, plen int) []byte {
	inner := 0
	if connID != 0 {
		inner += 1 + protowire.SizeVarint(connID)
	}
	if plen > 0 {
		inner += 1 + protowire.SizeVarint(uint64(plen)) + plen
	}
	dst = protowire.AppendTag(dst, dataFrameField, protowire.BytesType)
	dst = protowire.AppendVarint(dst, uint64(inner))
	if connID != 0 {
		dst = protowire.AppendTag(dst, connIDField, protowire.VarintType)
		dst = protowire.AppendVarint(dst, connID)
	}
	if plen > 0 {
		dst = protowire.AppendTag(dst, payloadField, protowire.BytesType)
		dst = protowire.AppendVarint(dst, uint64(plen))
	}
	return dst
}

// Unmarshal implements encoding.CodecV2.
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *Envelope:
		return unmarshalEnvelope(data, m)
	case proto.Message:
		return proto.Unmarshal(data.Materialize(), m)
	default:
		return fmt.Errorf("sluice codec: cannot unmarshal into %T", v)
	}
}

func unmarshalEnvelope(data mem.BufferSlice, e *Envelope) error {
	*e = Envelope{}
	if connID, start, n, ok := parseDataFrame(data); ok {
		e.ConnID = connID
		e.Payload = sliceRange(data, start, n)
		return nil
	}
	f := &Frame{}
	if err := proto.Unmarshal(data.Materialize(), f); err != nil {
		return err
	}
	if d := f.GetData(); d != nil {
		// A DATA frame encoded in a way the fast path does not take (fields
		// repeated or out of order): still a DATA frame.
		e.ConnID = d.ConnId
		if len(d.Payload) > 0 {
			e.Payload = mem.BufferSlice{mem.SliceBuffer(d.Payload)}
		}
		return nil
	}
	e.Frame = f
	return nil
}

// parseDataFrame recognises a Frame that is exactly one Data field and returns
// the connection id and the payload's offset and length within data.
func parseDataFrame(data mem.BufferSlice) (connID uint64, start, n int, ok bool) {
	total := data.Len()
	var head [40]byte
	h := head[:copyPrefix(data, head[:])]
	num, typ, tl := protowire.ConsumeTag(h)
	if tl < 0 || num != dataFrameField || typ != protowire.BytesType {
		return 0, 0, 0, false
	}
	inner, ll := protowire.ConsumeVarint(h[tl:])
	if ll < 0 || uint64(total) != uint64(tl+ll)+inner {
		return 0, 0, 0, false
	}
	pos := tl + ll
	seenPayload := false
	for pos < total && !seenPayload {
		if pos >= len(h) {
			return 0, 0, 0, false
		}
		fnum, ftyp, fl := protowire.ConsumeTag(h[pos:])
		if fl < 0 {
			return 0, 0, 0, false
		}
		switch {
		case fnum == connIDField && ftyp == protowire.VarintType:
			v, vl := protowire.ConsumeVarint(h[pos+fl:])
			if vl < 0 {
				return 0, 0, 0, false
			}
			connID = v
			pos += fl + vl
		case fnum == payloadField && ftyp == protowire.BytesType:
			v, vl := protowire.ConsumeVarint(h[pos+fl:])
			if vl < 0 {
				return 0, 0, 0, false
			}
			start = pos + fl + vl
			n = int(v)
			if uint64(start)+v != uint64(total) {
				return 0, 0, 0, false // payload must be the last field
			}
			seenPayload = true
			pos = total
		default:
			return 0, 0, 0, false
		}
	}
	if !seenPayload {
		start, n = total, 0
	}
	return connID, start, n, true
}

// copyPrefix copies the first len(dst) bytes of data into dst.
func copyPrefix(data mem.BufferSlice, dst []byte) int {
	n := 0
	for _, b := range data {
		n += copy(dst[n:], b.ReadOnlyData())
		if n == len(dst) {
			break
		}
	}
	return n
}

// sliceRange returns references to bytes [start, start+n) of data. The
// returned buffers hold their own references; data may be freed.
func sliceRange(data mem.BufferSlice, start, n int) mem.BufferSlice {
	if n == 0 {
		return nil
	}
	out := make(mem.BufferSlice, 0, len(data))
	off := 0
	end := start + n
	for _, b := range data {
		bl := b.Len()
		lo, hi := max(start, off), min(end, off+bl)
		if lo < hi {
			out = append(out, b.Slice(lo-off, hi-off))
		}
		off += bl
		if off >= end {
			break
		}
	}
	return out
}
