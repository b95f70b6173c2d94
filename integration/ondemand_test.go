package integration

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
)

// onDemandGlobal asks the sluice permission module before on-demand TLS
// gets a certificate.
const onDemandGlobal = `on_demand_tls {
		permission sluice
	}`

// onDemandSite is a catch-all HTTPS site whose certificates the local CA
// issues at handshake time, for the hosts the permission allows.
const onDemandSite = `:{HTTPS} {
	tls internal {
		on_demand
	}
	sluice
}`

// TestOnDemandTLSForAdvertisedHosts: with `permission sluice`, a TLS
// client gets a certificate, issued at its handshake by Caddy's local CA,
// for a host an agent advertises (exactly or by a host pattern), and none
// for a host no agent serves, nor for one only a catch-all route serves;
// a host gets one as soon as an agent advertises it, and a new name stops
// getting one once the agent serving it has gone.
func TestOnDemandTLSForAdvertisedHosts(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Global: onDemandGlobal}, onDemandSite)
	roots := localCARoots(t, c)

	up := startUpstream(t, "ondemand-app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.ondemand.test", Target: up})

	t.Run("an advertised host gets a certificate and reaches its upstream", func(t *testing.T) {
		leaf, err := onDemandHandshake(c, roots, "app.ondemand.test")
		if err != nil {
			t.Fatalf("handshake for an advertised host: %v", err)
		}
		if !slices.Contains(leaf.DNSNames, "app.ondemand.test") {
			t.Fatalf("certificate for %v, want app.ondemand.test among them", leaf.DNSNames)
		}
		if body, err := onDemandGet(c, roots, "app.ondemand.test", "app.ondemand.test"); err != nil || !strings.HasPrefix(body, "200 Hello from ondemand-app: host=app.ondemand.test") {
			t.Fatalf("HTTPS request: %q %v", body, err)
		}
	})

	t.Run("a host no agent serves gets none", func(t *testing.T) {
		if _, err := onDemandHandshake(c, roots, "nobody.ondemand.test"); err == nil {
			t.Fatal("a certificate for a host no agent serves")
		}
	})

	t.Run("a host gets one once an agent advertises it", func(t *testing.T) {
		if _, err := onDemandHandshake(c, roots, "late.ondemand.test"); err == nil {
			t.Fatal("a certificate for late.ondemand.test before any agent serves it")
		}
		late := startUpstream(t, "ondemand-late")
		startAgent(t, c.serverURL(), "agent-late", agent.Upstream{Host: "late.ondemand.test", Target: late})
		leaf, err := onDemandHandshake(c, roots, "late.ondemand.test")
		if err != nil {
			t.Fatalf("handshake once an agent advertises the host: %v", err)
		}
		if !slices.Contains(leaf.DNSNames, "late.ondemand.test") {
			t.Fatalf("certificate for %v", leaf.DNSNames)
		}
		if body, err := onDemandGet(c, roots, "late.ondemand.test", "late.ondemand.test"); err != nil || !strings.HasPrefix(body, "200 Hello from ondemand-late") {
			t.Fatalf("HTTPS request: %q %v", body, err)
		}
	})

	t.Run("a host only the catch-all serves gets none", func(t *testing.T) {
		catchAll := startUpstream(t, "ondemand-catchall")
		startAgent(t, c.serverURL(), "agent-catchall", agent.Upstream{Target: catchAll})
		// The catch-all serves stray.ondemand.test: a request for it on
		// a connection whose certificate is app.ondemand.test's reaches
		// the catch-all's upstream...
		if body, err := onDemandGet(c, roots, "app.ondemand.test", "stray.ondemand.test"); err != nil || !strings.HasPrefix(body, "200 Hello from ondemand-catchall: host=stray.ondemand.test") {
			t.Fatalf("a request the catch-all serves: %q %v", body, err)
		}
		// ...but the host gets no certificate of its own.
		if _, err := onDemandHandshake(c, roots, "stray.ondemand.test"); err == nil {
			t.Fatal("a certificate for a host only the catch-all serves")
		}
	})

	t.Run("a host pattern grants the names it matches", func(t *testing.T) {
		preview := startUpstream(t, "ondemand-preview")
		a := startAgent(t, c.serverURL(), "agent-preview",
			agent.Upstream{HostPattern: `pr-[0-9]+\.preview\.ondemand\.test`, Target: preview})
		leaf, err := onDemandHandshake(c, roots, "pr-1.preview.ondemand.test")
		if err != nil {
			t.Fatalf("handshake for a name the pattern matches: %v", err)
		}
		if !slices.Contains(leaf.DNSNames, "pr-1.preview.ondemand.test") {
			t.Fatalf("certificate for %v", leaf.DNSNames)
		}
		if body, err := onDemandGet(c, roots, "pr-1.preview.ondemand.test", "pr-1.preview.ondemand.test"); err != nil || !strings.HasPrefix(body, "200 Hello from ondemand-preview") {
			t.Fatalf("HTTPS request: %q %v", body, err)
		}
		if _, err := onDemandHandshake(c, roots, "main.preview.ondemand.test"); err == nil {
			t.Fatal("a certificate for a name the pattern does not match")
		}

		// Once the agent is gone, a name its pattern matched gets none
		// (pr-1's certificate, already in memory, is Caddy's to keep).
		// A handshake that raced the agent's leaving would get pr-2 a
		// certificate Caddy then keeps: ask once the node no longer
		// routes the pattern.
		a.stop()
		eventually(t, 10*time.Second, "the pattern's route gone from the node", func() bool {
			body, err := onDemandGet(c, roots, "pr-1.preview.ondemand.test", "pr-1.preview.ondemand.test")
			return err == nil && !strings.HasPrefix(body, "200 ")
		})
		if _, err := onDemandHandshake(c, roots, "pr-2.preview.ondemand.test"); err == nil {
			t.Fatal("a certificate for a name the pattern of an agent that left matches")
		}
	})
}

// localCARoots trusts the root of Caddy's local CA, from the test's
// storage: the certificates on-demand TLS gets are then verified, names
// included, as a browser trusting the CA would.
func localCARoots(t *testing.T, c *caddyServer) *x509.CertPool {
	t.Helper()
	pemBytes, err := os.ReadFile(filepath.Join(c.storage, "pki", "authorities", "local", "root.crt"))
	if err != nil {
		t.Fatalf("the local CA's root: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pemBytes) {
		t.Fatal("the local CA's root.crt holds no certificate")
	}
	return roots
}

// onDemandHandshake runs a TLS handshake with the HTTPS port for
// serverName, verifying the certificate against roots, and returns it.
func onDemandHandshake(c *caddyServer, roots *x509.CertPool, serverName string) (*x509.Certificate, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d := tls.Dialer{Config: &tls.Config{ServerName: serverName, RootCAs: roots}}
	conn, err := d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", c.httpsPort))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return conn.(*tls.Conn).ConnectionState().PeerCertificates[0], nil
}

// onDemandGet GETs / over HTTPS from the HTTPS port with serverName and
// the Host host, and returns "<status> <body>".
func onDemandGet(c *caddyServer, roots *x509.CertPool, serverName, host string) (string, error) {
	addr := fmt.Sprintf("127.0.0.1:%d", c.httpsPort)
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{ServerName: serverName, RootCAs: roots},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequest(http.MethodGet, "https://"+addr+"/", nil)
	if err != nil {
		return "", err
	}
	req.Host = host
	resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return fmt.Sprintf("%d %s", resp.StatusCode, b), err
}
