package tunnelcore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
	"testing/iotest"
)

// laneBytes frames msgs as the lane does: 0, a 4-byte length, the bytes.
func laneBytes(msgs ...[]byte) []byte {
	var out []byte
	for _, m := range msgs {
		out = append(out, 0)
		out = binary.BigEndian.AppendUint32(out, uint32(len(m)))
		out = append(out, m...)
	}
	return out
}

// readAll reads messages until an error and returns them with the error.
func readAll(r io.Reader) ([][]byte, error) {
	l := laneReader{r: r}
	defer l.dropChunk()
	var got [][]byte
	for {
		msg, err := l.next()
		if err != nil {
			return got, err
		}
		got = append(got, msg.Materialize())
		msg.Free()
	}
}

// randomReads returns at most a random number of bytes per Read, so
// messages and headers split at every kind of place.
type randomReads struct {
	r   io.Reader
	rng *rand.Rand
}

func (r randomReads) Read(p []byte) (int, error) {
	n := 1 + r.rng.IntN(len(p))
	if r.rng.IntN(4) == 0 {
		n = min(n, 7)
	}
	return r.r.Read(p[:n])
}

func TestLaneReaderSplitsMessagesAnyHowTheBytesArrive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var msgs [][]byte
	// Sizes around the chunk's edges and far beyond it, and empty ones.
	for _, n := range []int{0, 1, 5, 100, laneChunk - 5, laneChunk, laneChunk + 1, 3 * laneChunk, 17, 0, minLaneRead, 1 << 20} {
		m := make([]byte, n)
		for i := range m {
			m[i] = byte(rng.Uint32())
		}
		msgs = append(msgs, m)
	}
	for i := 0; i < 200; i++ {
		m := make([]byte, rng.IntN(40<<10))
		for j := range m {
			m[j] = byte(i + j)
		}
		msgs = append(msgs, m)
	}
	stream := laneBytes(msgs...)
	readers := map[string]io.Reader{
		"whole":   bytes.NewReader(stream),
		"onebyte": iotest.OneByteReader(bytes.NewReader(stream)),
		"random":  randomReads{bytes.NewReader(stream), rng},
	}
	for name, r := range readers {
		got, err := readAll(r)
		if err != io.EOF {
			t.Fatalf("%s: ended with %v, want io.EOF", name, err)
		}
		if len(got) != len(msgs) {
			t.Fatalf("%s: %d messages, want %d", name, len(got), len(msgs))
		}
		for i := range msgs {
			if !bytes.Equal(got[i], msgs[i]) {
				t.Fatalf("%s: message %d (%d bytes) differs", name, i, len(msgs[i]))
			}
		}
	}
}

func TestLaneReaderRefusesBrokenStreams(t *testing.T) {
	whole := laneBytes([]byte("hello"), []byte("world"))
	tooLarge := []byte{0, 0xff, 0xff, 0xff, 0xff}
	cases := []struct {
		name  string
		bytes []byte
		want  error
	}{
		{"cut inside a header", whole[:len(whole)-8], io.ErrUnexpectedEOF},
		{"cut inside a payload", whole[:len(whole)-2], io.ErrUnexpectedEOF},
		{"length over the limit", tooLarge, ErrLaneMessageTooLarge},
		{"compressed", []byte{1, 0, 0, 0, 1, 'x'}, ErrLaneCompressed},
	}
	for _, tc := range cases {
		_, err := readAll(bytes.NewReader(tc.bytes))
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
}
