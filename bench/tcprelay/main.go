// Command tcprelay is the benches' measure of what one more process on the
// path costs by itself: a TCP relay with nothing in it but a copy loop each
// way (256 KiB buffers, no framing, no multiplexing, no splice), put between
// Caddy and the upstream. Any tunnel adds at least this hop; what sluice
// costs beyond it is the tunnel's own.
//
//	tcprelay -listen 127.0.0.1:9001 -to 127.0.0.1:9000
package main

import (
	"flag"
	"io"
	"log"
	"net"
	"time"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to accept on")
	to := flag.String("to", "", "address to relay each connection to")
	flag.Parse()
	if *to == "" {
		log.Fatal("tcprelay: -to is required")
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			// Transient (EMFILE under a load's burst): the bench goes on.
			log.Print(err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go relay(c.(*net.TCPConn), *to)
	}
}

func relay(client *net.TCPConn, to string) {
	defer client.Close()
	up, err := net.Dial("tcp", to)
	if err != nil {
		return
	}
	defer up.Close()
	upTCP := up.(*net.TCPConn)
	done := make(chan struct{})
	go func() {
		copyLoop(upTCP, client, client)
		close(done)
	}()
	copyLoop(client, upTCP, upTCP)
	<-done
}

// copyLoop copies with a plain read/write loop (io.Copy between two TCP
// connections would splice, which no tunnel can), then half-closes dst at
// the source's EOF. A failed write or a read error other than EOF closes
// both connections, so the other direction ends too.
func copyLoop(dst, src, other *net.TCPConn) {
	buf := make([]byte, 256<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				dst.Close()
				other.Close()
				return
			}
		}
		if err == io.EOF {
			dst.CloseWrite()
			return
		}
		if err != nil {
			dst.Close()
			other.Close()
			return
		}
	}
}
