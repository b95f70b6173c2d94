//go:build !linux

package tunnelcore

import "net"

// socketProgress has no portable source of delivered bytes off Linux: the
// stall watchdog times blocked Sends alone there.
func socketProgress(net.Conn) func() uint64 { return nil }

// sendQueue has no portable source off Linux: a relay then gives a real
// side closeFlush after its half-close instead.
func sendQueue(net.Conn) func() int { return nil }

// readQueue has no portable source off Linux: a copy from a direct socket
// then reads into a medium buffer each time.
func readQueue(net.Conn) func() int { return nil }
