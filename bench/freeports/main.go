// Command freeports prints N loopback TCP ports that were free a moment ago,
// one per line. All N are held open together while choosing, so they are
// distinct; another process may still take one before the caller binds it.
// With -udp each port is also free for UDP (bench/udp.sh binds both on
// one number: iperf3's control connection and its datagrams); with
// -consecutive the N ports follow one another (a port range).
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
)

func main() {
	n := flag.Int("n", 1, "number of ports")
	udp := flag.Bool("udp", false, "each port is free for UDP too")
	consecutive := flag.Bool("consecutive", false, "the ports follow one another")
	flag.Parse()
	if *n < 1 || *n > 64 {
		fmt.Fprintln(os.Stderr, "freeports: -n must be in 1..64")
		os.Exit(2)
	}
	var held []io.Closer
	var ports []int
	for tries := 0; len(ports) < *n; tries++ {
		if tries > 100**n {
			fmt.Fprintln(os.Stderr, "freeports: not enough free ports")
			os.Exit(1)
		}
		want := 0 // any
		if *consecutive && len(ports) > 0 {
			want = ports[len(ports)-1] + 1
		}
		cs, port, ok := take(want, *udp)
		if !ok {
			if want != 0 { // the run is broken: start another
				closeAll(held)
				held, ports = nil, nil
			}
			continue
		}
		held = append(held, cs...)
		ports = append(ports, port)
	}
	for _, p := range ports {
		fmt.Println(p)
	}
	closeAll(held)
}

// take binds port (0: any) on loopback for TCP, and UDP too if udp; it
// returns what it holds open and the port, or false if it is taken.
func take(port int, udp bool) ([]io.Closer, int, bool) {
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return nil, 0, false
	}
	held := []io.Closer{l}
	if udp {
		pc, err := net.ListenPacket("udp", l.Addr().String())
		if err != nil {
			l.Close()
			return nil, 0, false
		}
		held = append(held, pc)
	}
	return held, l.Addr().(*net.TCPAddr).Port, true
}

func closeAll(cs []io.Closer) {
	for _, c := range cs {
		c.Close()
	}
}
