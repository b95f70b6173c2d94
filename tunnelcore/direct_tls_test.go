package tunnelcore

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// testCert is a self-signed certificate for TLS direct sockets.
func testCert(t *testing.T) tls.Certificate {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "x"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"x"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// tlsDirect puts direct sockets under TLS, as the agent's dialLane and the
// node's laneCreds do on a grpcs:// control plane.
func tlsDirect(t *testing.T) directOpts {
	cert := testCert(t)
	return directOpts{wrap: &socketWrap{
		server: func(raw net.Conn) net.Conn {
			return tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{cert}})
		},
		client: func(raw net.Conn) net.Conn {
			return tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
		},
	}}
}

// Under TLS, aborting a moved connection whose peer stopped reading must
// not block (fail runs on the receive loop, and the session's end runs it
// for every connection).
func TestDirectAbortOverTLSDoesNotBlock(t *testing.T) {
	node, agent := directPairWith(t, transport{"lane", lanePair}, 1, tlsDirect(t))
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
