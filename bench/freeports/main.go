// Command freeports prints N loopback TCP ports that were free a moment ago,
// one per line. All N are held open together while choosing, so they are
// distinct; another process may still take one before the caller binds it.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"
)

func main() {
	n := flag.Int("n", 1, "number of ports")
	flag.Parse()
	if *n < 1 || *n > 64 {
		fmt.Fprintln(os.Stderr, "freeports: -n must be in 1..64")
		os.Exit(2)
	}
	var ls []net.Listener
	for i := 0; i < *n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fmt.Fprintln(os.Stderr, "freeports:", err)
			os.Exit(1)
		}
		ls = append(ls, l)
	}
	for _, l := range ls {
		fmt.Println(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	}
}
