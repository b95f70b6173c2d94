package tunnelcore

import (
	"fmt"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The session's receive side: the loop that reads the peer's frames and
// hands each to its connection, and the Connect frames that open them.

// recvLoop reads frames until the stream fails; it is the only reader of
// the stream.
func (s *Session) recvLoop() {
	for {
		s.waitControlRoom() // returns at once once the session is done
		env := &tunnelpb.Envelope{}
		if err := s.stream.Recv(env); err != nil {
			env.Payload.Free()
			s.CloseWithError(err)
			return
		}
		if s.isDone() {
			// After the end, what the peer still sends is read and
			// dropped until the stream fails, which closing it makes
			// happen at once. A stream that ends by a half-close (the
			// node's data lane) is read until its peer closes too:
			// closing a socket with bytes unread resets the connection,
			// which can discard what the peer has not read yet.
			env.Payload.Free()
			continue
		}
		s.dispatch(env)
	}
}

func (s *Session) dispatch(env *tunnelpb.Envelope) {
	if env.IsData() {
		if c := s.lookup(env.ConnID); c != nil {
			c.onData(env.Payload)
		} else {
			env.Payload.Free() // late data for a connection already gone
		}
		return
	}
	f := env.Frame
	switch k := f.Kind.(type) {
	case *tunnelpb.Frame_Connect:
		s.onConnect(k.Connect)
	case *tunnelpb.Frame_Close:
		if c := s.lookup(k.Close.GetConnId()); c != nil {
			if k.Close.GetMoved() {
				c.onPeerMoved()
			} else {
				c.onPeerClose()
			}
		}
	case *tunnelpb.Frame_WindowUpdate:
		if k.WindowUpdate.GetIncrement() > 0 {
			s.count(windowUpdatesReceived)
		}
		if c := s.lookup(k.WindowUpdate.GetConnId()); c != nil {
			c.onWindowUpdate(k.WindowUpdate)
		}
	case *tunnelpb.Frame_Error:
		if k.Error.GetConnId() == 0 {
			s.control(f)
			return
		}
		if c := s.lookup(k.Error.GetConnId()); c != nil {
			c.onPeerError(k.Error)
		}
	default:
		s.control(f)
	}
}

func (s *Session) control(f *tunnelpb.Frame) {
	if s.cfg.OnControl != nil {
		s.cfg.OnControl(f)
	}
}

// onConnect accepts a connection the peer opened, or refuses it with an Error.
func (s *Session) onConnect(m *tunnelpb.Connect) {
	id := m.GetConnId()
	peerParity := uint64(1)
	if s.cfg.Role == RoleAgent {
		peerParity = 0
	}
	if id == 0 {
		if ok, suppressed := s.peerLog.Allow(); ok {
			s.cfg.Logger.Warn("tunnel peer sent Connect with connection id 0; ignored", zap.Int("suppressed", suppressed))
		}
		return
	}
	if id%2 != peerParity {
		s.refuse(id, tunnelpb.Error_PROTOCOL, fmt.Sprintf("connection id %d is not in the opener's id space", id))
		return
	}
	if msg := s.cfg.RefuseOpens; msg != "" {
		s.sendPacedControl(errorFrame(id, tunnelpb.Error_REFUSED, msg))
		return
	}
	if m.GetWindow() < InitialWindow && !m.GetDatagram() { // a flow has no credit
		s.refuse(id, tunnelpb.Error_PROTOCOL, fmt.Sprintf("connect window %d below the protocol minimum %d", m.GetWindow(), InitialWindow))
		return
	}
	c := newConn(s, id, ConnectInfo{
		RouteKey:   m.GetRouteKey(),
		RemoteAddr: m.GetRemoteAddr(),
		LocalAddr:  m.GetLocalAddr(),
		ServerName: m.GetServerName(),
		Datagram:   m.GetDatagram(),
	}, int64(m.GetWindow()))
	if m.GetDatagram() {
		c.flow, c.credit = newFlowState(s), 0
	}
	s.mu.Lock()
	if s.isDone() {
		// The session ended since the receive loop looked: the table it
		// failed is final, and a connection added now would never be
		// failed, removed or given its slot back.
		s.mu.Unlock()
		return
	}
	if _, dup := s.conns[id]; dup {
		s.mu.Unlock()
		s.refuse(id, tunnelpb.Error_PROTOCOL, fmt.Sprintf("connection id %d already open", id))
		return
	}
	if !s.cfg.Slots.TryAcquire() {
		s.mu.Unlock()
		s.sendPacedControl(errorFrame(id, tunnelpb.Error_RESOURCE_EXHAUSTED, "connection limit reached"))
		return
	}
	c.slot = true
	s.conns[id] = c
	s.mu.Unlock()
	c.flow.start(c)
	select {
	case s.accept <- c:
	default:
		c.fail(ErrBacklogFull, tunnelpb.Error_RESOURCE_EXHAUSTED, "accept backlog full")
	}
}

func (s *Session) refuse(id uint64, code tunnelpb.Error_Code, msg string) {
	if ok, suppressed := s.peerLog.Allow(); ok {
		s.cfg.Logger.Warn("tunnel connect refused", zapConn(id), zap.String("reason", msg), zap.Int("suppressed", suppressed))
	}
	s.sendPacedControl(errorFrame(id, code, msg))
}

func (s *Session) logFlowViolation(id uint64) {
	if ok, suppressed := s.flowLog.Allow(); ok {
		s.cfg.Logger.Warn("tunnel peer sent beyond its credit; connection failed",
			zapConn(id), zap.Int("suppressed", suppressed))
	}
}
