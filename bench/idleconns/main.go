// Command idleconns opens N HTTP/1.1 keep-alive connections to one address,
// sends one request on each and reads the whole response, then prints
// "ready" and holds the connections idle until its stdin closes (or the
// -hold timeout passes), and closes them. bench/http.sh uses it to measure
// the memory an idle keep-alive connection costs a server.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"time"
)

func main() {
	addr := flag.String("addr", "", "host:port to connect to")
	host := flag.String("host", "app.test", "Host header")
	path := flag.String("path", "/", "request path")
	n := flag.Int("n", 500, "number of connections")
	parallel := flag.Int("parallel", 8, "connections being set up at once")
	hold := flag.Duration("hold", 60*time.Second, "longest time to hold the connections")
	flag.Parse()
	if *addr == "" || *n < 1 || *parallel < 1 {
		fmt.Fprintln(os.Stderr, "idleconns: need -addr, -n >= 1, -parallel >= 1")
		os.Exit(2)
	}

	conns := make([]net.Conn, *n)
	errs := make(chan error, *n)
	sem := make(chan struct{}, *parallel)
	var wg sync.WaitGroup
	deadline := time.Now().Add(30 * time.Second)
	for i := range conns {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := open(*addr, *host, *path, deadline)
			if err != nil {
				errs <- fmt.Errorf("connection %d: %w", i, err)
				return
			}
			conns[i] = c
		}()
	}
	wg.Wait()
	close(errs)
	closeAll := func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}
	if err := <-errs; err != nil {
		closeAll()
		fmt.Fprintln(os.Stderr, "idleconns:", err)
		os.Exit(1)
	}
	fmt.Println("ready")

	done := make(chan struct{})
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(*hold):
		fmt.Fprintln(os.Stderr, "idleconns: hold timeout; closing")
	}
	closeAll()
}

// open dials addr, sends one keep-alive GET and reads the full response,
// leaving the connection open and idle.
func open(addr, host, path string, deadline time.Time) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, time.Until(deadline))
	if err != nil {
		return nil, err
	}
	c.SetDeadline(deadline)
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: sluice-bench-idleconns\r\n\r\n", path, host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("status %s", resp.Status)
		}
		if err == nil && resp.Close {
			err = fmt.Errorf("server closed the connection (no keep-alive)")
		}
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	c.SetDeadline(time.Time{})
	return c, nil
}
