//go:build !linux

package tunnelcore

import "net"

// socketProgress has no portable source of delivered bytes off Linux: the
// stall watchdog times blocked Sends alone there.
func socketProgress(net.Conn) func() uint64 { return nil }
