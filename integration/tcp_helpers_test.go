package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"
	"go.uber.org/zap"
)

// loopback is 127.0.0.1:port.
func loopback(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// tcpTarget is the tcp:// target of a loopback port.
func tcpTarget(port int) string { return "tcp://" + loopback(port) }

// portRangeGlobal is the sluice global block that lets agents claim ports
// lo..hi, bound on loopback.
func portRangeGlobal(lo, hi int) string {
	return fmt.Sprintf("\tsluice {\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1\n\t}\n", lo, hi)
}

// serveTCP runs handle for every connection to a new loopback listener and
// returns its port. Cleanup closes the listener and open connections and
// waits for the handlers.
func serveTCP(t testing.TB, handle func(net.Conn)) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
		wg    sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					c.Close()
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
				}()
				handle(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().(*net.TCPAddr).Port
}

// echoHandler echoes until the client half-closes, then half-closes too.
func echoHandler(c net.Conn) {
	io.Copy(c, c)
	c.(*net.TCPConn).CloseWrite()
	io.Copy(io.Discard, c)
}

// greetEchoHandler writes name and a newline, then echoes.
func greetEchoHandler(name string) func(net.Conn) {
	return func(c net.Conn) {
		fmt.Fprintf(c, "%s\n", name)
		echoHandler(c)
	}
}

// digest is what the half-close upstreams report: length and SHA-256.
func digest(b []byte) string {
	h := sha256.Sum256(b)
	return fmt.Sprintf("%d %s", len(b), hex.EncodeToString(h[:]))
}

// countHandler reads everything until EOF, then writes the digest of it and
// closes: it only answers once the client half-closed.
func countHandler(c net.Conn) {
	b, err := io.ReadAll(c)
	if err != nil {
		return
	}
	fmt.Fprintf(c, "%s\n", digest(b))
}

// readAllWithin reads all of c until EOF within d.
func readAllWithin(c net.Conn, d time.Duration) ([]byte, error) {
	c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	return io.ReadAll(c)
}

// dialEcho dials addr, writes msg, half-closes and reads the echo.
func dialEcho(addr string, msg []byte) ([]byte, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(msg); err != nil {
		return nil, err
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return nil, err
	}
	return io.ReadAll(c)
}

// echoWorks reports whether an echo exchange through addr succeeds.
func echoWorks(addr string) error {
	msg := []byte("ping " + strconv.FormatInt(time.Now().UnixNano(), 10))
	got, err := dialEcho(addr, msg)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}

// greeting dials addr and returns the first line the upstream writes.
func greeting(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// expectClosedWithin asserts the peer closes c within d: a read returns EOF
// or a reset, not a timeout, and no data.
func expectClosedWithin(t testing.TB, c net.Conn, d time.Duration) {
	t.Helper()
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(d))
	n, err := c.Read(make([]byte, 1024))
	var ne net.Error
	switch {
	case n > 0:
		t.Fatalf("read %d bytes from a connection that should be closed", n)
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatalf("connection still open after %v", d)
	case err == nil:
		t.Fatal("read returned no error and no data")
	}
	t.Logf("closed after %v (%v)", time.Since(start).Round(time.Millisecond), err)
}

// proxyReport is what the PROXY-protocol upstream saw.
type proxyReport struct {
	src, dst string
	version  byte
	err      error
}

// proxyEchoHandler requires a PROXY header (v1 or v2), writes "src dst\n"
// from it, then echoes the rest of the stream. Each header is reported on
// ch.
func proxyEchoHandler(ch chan<- proxyReport) func(net.Conn) {
	return func(c net.Conn) {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		h, err := proxyproto.Read(br)
		c.SetReadDeadline(time.Time{})
		if err != nil {
			ch <- proxyReport{err: err}
			fmt.Fprintf(c, "no PROXY header: %v\n", err)
			return
		}
		ch <- proxyReport{src: h.SourceAddr.String(), dst: h.DestinationAddr.String(), version: h.Version}
		fmt.Fprintf(c, "%s %s\n", h.SourceAddr, h.DestinationAddr)
		io.Copy(c, br)
		c.(*net.TCPConn).CloseWrite()
	}
}

// runCmd runs a client command with a bounded time, stdin optional, and
// returns its standard output (standard error is in the error).
func runCmd(t testing.TB, stdin []byte, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// startRedis runs redis-server on a free loopback port and waits until it
// answers PING. It skips when redis-server or redis-cli is missing.
func startRedis(t *testing.T) int {
	t.Helper()
	bin := needCommand(t, "redis-server")
	needCommand(t, "redis-cli")
	port := freePort(t)
	startProcess(t, bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", t.TempDir())
	eventually(t, 10*time.Second, "redis-server answers PING", func() bool {
		r, err := dialRESP(loopback(port))
		if err != nil {
			return false
		}
		defer r.Close()
		v, err := r.do("PING")
		return err == nil && v == "PONG"
	})
	return port
}

// respConn is a minimal Redis (RESP2) client.
type respConn struct {
	net.Conn
	r *bufio.Reader
}

func dialRESP(addr string) (*respConn, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	return &respConn{Conn: c, r: bufio.NewReader(c)}, nil
}

// send writes one command.
func (r *respConn) send(args ...string) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	r.SetWriteDeadline(time.Now().Add(10 * time.Second))
	_, err := r.Write(b.Bytes())
	return err
}

// do sends one command and reads its reply, within 10 s.
func (r *respConn) do(args ...string) (any, error) {
	if err := r.send(args...); err != nil {
		return nil, err
	}
	return r.readWithin(10 * time.Second)
}

func (r *respConn) readWithin(d time.Duration) (any, error) {
	r.SetReadDeadline(time.Now().Add(d))
	defer r.SetReadDeadline(time.Time{})
	return r.read()
}

// read parses one reply: string (simple or bulk), int64, error, nil or
// []any.
func (r *respConn) read() (any, error) {
	line, err := r.r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return nil, errors.New("resp: empty line")
	}
	switch line[0] {
	case '+':
		return line[1:], nil
	case '-':
		return nil, errors.New("redis: " + line[1:])
	case ':':
		return strconv.ParseInt(line[1:], 10, 64)
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return nil, err
		}
		b := make([]byte, n+2)
		if _, err := io.ReadFull(r.r, b); err != nil {
			return nil, err
		}
		return string(b[:n]), nil
	case '*':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return nil, err
		}
		out := make([]any, n)
		for i := range out {
			if out[i], err = r.read(); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("resp: unexpected %q", line)
}

// zapUint32 is the log field the agent writes for a port.
func zapUint32(key string, v int) zap.Field { return zap.Uint32(key, uint32(v)) }

// portFree reports whether addr can be bound (nothing listens there).
func portFree(addr string) bool {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	ln.Close()
	return true
}
