package tunnelcore

import "google.golang.org/grpc/mem"

// smallPayload is the size below which a received DATA payload is copied
// into the connection's open chunk instead of being buffered by reference.
//
// The receive window counts payload bytes, but what a buffered payload holds
// is more: the buffer the transport read it into (gRPC reads each 16 KiB
// HTTP/2 frame into one pooled buffer, and a payload sliced out of it keeps
// the whole buffer alive) and a queue entry of its own. A peer sending
// one-byte DATA frames to a connection whose reader has stalled would
// otherwise make each byte of the window hold up to a 16 KiB buffer, or at
// least a hundred bytes of bookkeeping: a 64 KiB window could pin a GiB.
// Gathered, small payloads cost what they carry. A payload of at least
// 16 KiB in no more pieces than 16 KiB frames make of it holds at most two
// frame buffers beyond its own bytes, so it is kept by reference as bulk
// transfers (256 KiB frames) are, without a copy.
const smallPayload = 16 << 10

// openChunkSize is the size of the pooled chunk small payloads are gathered
// in; a tier of the buffer pool.
const openChunkSize = 16 << 10

// recvQueue holds a connection's received payloads in order: buffers kept
// by reference (rq), then the open chunk small payloads are gathered in.
// It is embedded in Conn and guarded by the connection's mu.
type recvQueue struct {
	rq      fifo[mem.Buffer]
	open    *[]byte // small payloads gathered after rq's last buffer (see smallPayload)
	openLen int     // bytes of open in use
}

// bufferLocked appends a received payload of n bytes to the receive queue,
// taking ownership of it. A payload is kept by reference when it is large
// and in few pieces: the peer picks the HTTP/2 framing, and a bulk payload
// sent as thousands of one-byte HTTP/2 frames arrives as thousands of
// buffers.
func (q *recvQueue) bufferLocked(payload mem.BufferSlice, n int64) {
	if n >= smallPayload && len(payload) <= 2+int(n/smallPayload) {
		q.sealOpenLocked() // what was gathered came first
		for _, b := range payload {
			q.rq.push(b)
		}
		return
	}
	for _, b := range payload {
		q.gatherLocked(b.ReadOnlyData())
	}
	payload.Free()
}

// gatherLocked copies data into the open chunk, sealing each chunk it
// fills.
func (q *recvQueue) gatherLocked(data []byte) {
	for len(data) > 0 {
		if q.open == nil {
			q.open = bufferPool.Get(openChunkSize)
			q.openLen = 0
		}
		m := copy((*q.open)[q.openLen:], data)
		q.openLen += m
		data = data[m:]
		if q.openLen == len(*q.open) {
			q.sealOpenLocked()
		}
	}
}

// sealOpenLocked moves the open chunk, if it holds anything, to the end of
// the receive queue.
func (q *recvQueue) sealOpenLocked() {
	if q.open == nil {
		return
	}
	if q.openLen == 0 {
		bufferPool.Put(q.open)
	} else {
		*q.open = (*q.open)[:q.openLen]
		q.rq.push(mem.NewBuffer(q.open, bufferPool))
	}
	q.open, q.openLen = nil, 0
}

// hasBufferedLocked reports whether received bytes wait for the reader.
func (q *recvQueue) hasBufferedLocked() bool {
	return q.rq.len() > 0 || q.openLen > 0
}

// nextBufferLocked reports whether the receive queue has a buffer at its
// head, sealing the open chunk when it is all that is left.
func (q *recvQueue) nextBufferLocked() bool {
	if q.rq.len() == 0 {
		q.sealOpenLocked()
	}
	return q.rq.len() > 0
}
