package tunnelcore

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"sync/atomic"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func reviewCert(t *testing.T) tls.Certificate {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "x"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"x"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// directPairTLS is directPair with the direct sockets under TLS, as the
// agent's dialLane and the node's laneCreds make them.
func directPairTLS(t *testing.T, above int64) (node, agent *Session) {
	t.Helper()
	cert := reviewCert(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	var nodeSess atomic.Pointer[Session]
	go func() {
		for {
			raw, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				c := tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{cert}})
				hello := make([]byte, tunnelpb.DirectHelloLength)
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				_, err := io.ReadFull(c, hello)
				c.SetReadDeadline(time.Time{})
				key, id, perr := tunnelpb.ParseDirectHello(hello)
				if err != nil || perr != nil || key != directKey || nodeSess.Load().AttachDirect(id, OverSocket(c, raw)) != nil {
					c.Close()
				}
			}()
		}
	}()
	agentCfg := Config{DirectAbove: above, DirectDial: func(ctx context.Context, id uint64) (net.Conn, error) {
		var d net.Dialer
		raw, err := d.DialContext(ctx, "tcp", lis.Addr().String())
		if err != nil {
			return nil, err
		}
		c := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
		if _, err := c.Write(tunnelpb.DirectHello(directKey, id)); err != nil {
			c.Close()
			return nil, err
		}
		var answer [1]byte
		if _, err := io.ReadFull(c, answer[:]); err != nil || answer[0] != tunnelpb.LaneAccepted {
			c.Close()
			return nil, errors.New("direct socket refused")
		}
		return OverSocket(c, raw), nil
	}}
	node, agent = sessionPair(t, transport{"lane", lanePair}, Config{}, agentCfg)
	nodeSess.Store(node)
	return node, agent
}

// Under TLS, an abort of a moved connection (the agent's relay cutting a
// response short) must not read as a clean EOF at the peer.
func TestDirectAbortOverTLSIsNotEOF(t *testing.T) {
	node, agent := directPairTLS(t, 1)
	nc, ac := openAccepted(t, node, agent)
	defer nc.Close()
	ac.Write([]byte("a"))
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	ac.Write([]byte("b"))
	if _, err := io.ReadFull(nc, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := nc.Read(make([]byte, 10)); done <- err }()
	ac.Abort(tunnelpb.Error_RESET, "upstream cut the response short")
	select {
	case err := <-done:
		var pe *PeerError
		if !errors.As(err, &pe) || pe.Code != tunnelpb.Error_RESET {
			t.Fatalf("read after the peer's abort = %v; want its RESET", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("read hung")
	}
}

// Under TLS, aborting a moved connection whose peer stopped reading must
// not block (fail runs on the receive loop, and the session's end runs it
// for every connection).
func TestDirectAbortOverTLSDoesNotBlock(t *testing.T) {
	node, agent := directPairTLS(t, 1)
	nc, ac := openAccepted(t, node, agent)
	defer nc.Close()
	ac.Write([]byte("a"))
	eventually(t, 5*time.Second, "both ends on the direct socket", func() bool { return nc.Direct() && ac.Direct() })
	// Fill the socket: nc does not read; the write gives up at its deadline.
	ac.SetWriteDeadline(time.Now().Add(time.Second))
	for {
		if _, err := ac.Write(make([]byte, 1<<20)); err != nil {
			break
		}
	}
	start := time.Now()
	ac.Abort(tunnelpb.Error_RESET, "x")
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Abort took %v", d)
	}
	start = time.Now()
	agent.Close()
	if d := time.Since(start); d > time.Second {
		t.Fatalf("session Close took %v", d)
	}
}
