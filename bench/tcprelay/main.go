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
	"log"
	"net"
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
			log.Fatal(err)
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
	done := make(chan struct{})
	go func() {
		copyLoop(up.(*net.TCPConn), client)
		close(done)
	}()
	copyLoop(client, up.(*net.TCPConn))
	<-done
}

// copyLoop copies with a plain read/write loop (io.Copy between two TCP
// connections would splice, which no tunnel can), then half-closes dst.
func copyLoop(dst, src *net.TCPConn) {
	buf := make([]byte, 256<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			dst.CloseWrite()
			return
		}
	}
}
