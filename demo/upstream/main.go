// Command upstream is the demo's private web application: the sample
// upstream of the integration tests on a loopback port.
package main

import (
	"flag"
	"log"
	"net"

	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:3000", "address to serve on")
	name := flag.String("name", "the private upstream", "name shown in greetings")
	flag.Parse()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("sample upstream %q serving HTTP/1.1 and h2c on http://%s", *name, ln.Addr())
	log.Fatal(sampleupstream.Server(sampleupstream.Handler(*name)).Serve(ln))
}
