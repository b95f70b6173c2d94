package tunnelcore

import (
	"io"
	"net"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestRelayEndsWhenItsConnBreaks: a relay between an upstream that ignores
// the half-close (it reads to EOF and never answers nor closes) and a
// virtual connection ends (closing both) once the virtual
// connection is aborted by the other end or its session ends, instead of
// waiting on the upstream's silence for good.
func TestRelayEndsWhenItsConnBreaks(t *testing.T) {
	for _, how := range []string{"peer abort", "session end"} {
		t.Run(how, func(t *testing.T) {
			node, agent := sessionPair(t, transports[0], Config{}, Config{})
			nc, _ := node.Open(ConnectInfo{})
			if _, err := nc.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			ac := accept(t, agent)

			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			testOver := make(chan struct{})
			defer close(testOver)
			halfClosed := make(chan struct{})
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				io.Copy(io.Discard, c) // to the half-close's EOF
				close(halfClosed)
				<-testOver // then silent, and open
			}()
			uc, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			relayed := make(chan RelayResult, 1)
			go func() { relayed <- Relay(uc, ac) }()

			// The other end half-closes (the upstream reads EOF and stays
			// silent), then gives up on the connection.
			nc.CloseWrite()
			select {
			case <-halfClosed:
			case <-time.After(5 * time.Second):
				t.Fatal("the half-close never reached the upstream")
			}
			switch how {
			case "peer abort":
				nc.Abort(tunnelpb.Error_CANCELED, "client gone")
			case "session end":
				node.Close()
			}
			select {
			case res := <-relayed:
				// A session's end reads as the connection closed; an abort
				// is an error.
				if how == "peer abort" && res.Err == nil {
					t.Error("the relay reported a clean end for an aborted connection")
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the relay still waits on the silent upstream")
			}
		})
	}
}
