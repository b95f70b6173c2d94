package integration

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/caddymodule"
)

// TestMTLSWithCaddyPKI runs the mTLS setup of the README with the real
// binaries: a control plane on `tls internal` with `client_auth { require
// }` and a credential with a client identity; `caddy sluice issue-cert`
// issues the agent's certificate; the sluice-agent binary connects with
// it (no token) and serves its route, on a data lane and direct sockets
// through the same TLS; an agent without a certificate, and one with a
// certificate of another CA, are refused at the handshake; revoking the
// serial and `caddy reload` end the session, the agent's retries are
// refused; a certificate issued into the same files is used at the
// agent's next attempt, without restarting it.
func TestMTLSWithCaddyPKI(t *testing.T) {
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	m := startMTLSCaddy(t, caddyBin)

	certs := t.TempDir()
	first := m.issueCert(t, "agent-1", certs)
	up := startUpstream(t, "mtls-app")
	files := func(name string) (string, string) {
		return filepath.Join(certs, name+".crt"), filepath.Join(certs, name+".key")
	}
	crt, key := files("agent-1")
	agent := startAgentProcess(t, agentBin, "-server", m.serverURL(), "-id", "mtls-agent",
		"-cert-file", crt, "-key-file", key, "-ca-file", filepath.Join(certs, "ca.crt"),
		"-upstream", "host=app.test,target="+up)
	eventually(t, 20*time.Second, "app.test served through the agent with its certificate", func() bool {
		code, body := m.get("app.test", "/")
		return code == 200 && strings.Contains(body, "Hello from mtls-app")
	})
	s := m.session(t, "mtls-agent")
	if s.Credential != "team-a" || s.Transport != "lane" {
		t.Fatalf("session: credential %q transport %q; want team-a on a data lane", s.Credential, s.Transport)
	}
	// A bulk download moves to a direct socket, which handshakes with the
	// same client certificate.
	if code, n := m.download(t, "app.test", 8<<20); code != 200 || n != 8<<20 {
		t.Fatalf("download: %d, %d bytes", code, n)
	}
	if s := m.session(t, "mtls-agent"); s.Direct < 1 {
		t.Fatalf("the download went through %d direct sockets; want one", s.Direct)
	}

	t.Run("no certificate", func(t *testing.T) {
		p := startAgentProcess(t, agentBin, "-server", m.serverURL(), "-id", "no-cert",
			"-token", "no-cert-token-0123456789abcdef0123", "-ca-file", filepath.Join(certs, "ca.crt"),
			"-upstream", "host=app.test,target="+up)
		eventually(t, 20*time.Second, "the certificate-less agent refused at the handshake", func() bool {
			return p.logged("the node requires a client certificate")
		})
	})
	t.Run("certificate of another CA", func(t *testing.T) {
		dir := t.TempDir()
		crt, key := foreignClientCert(t, dir, "urn:sluice:team-a")
		p := startAgentProcess(t, agentBin, "-server", m.serverURL(), "-id", "foreign",
			"-cert-file", crt, "-key-file", key, "-ca-file", filepath.Join(certs, "ca.crt"),
			"-upstream", "host=app.test,target="+up)
		eventually(t, 20*time.Second, "the foreign certificate refused at the handshake", func() bool {
			return p.logged("the node refused the client certificate") || p.logged("the node requires a client certificate")
		})
	})
	if m.hasSession(t, "no-cert") || m.hasSession(t, "foreign") {
		t.Fatal("a refused agent has a session")
	}

	// Revoke the agent's certificate: the reload ends its session, its
	// retries are refused.
	m.reload(t, first.serial)
	eventually(t, 20*time.Second, "the revoked agent's session ended", func() bool {
		code, _ := m.get("app.test", "/")
		return (code == 502 || code == 503) && !m.hasSession(t, "mtls-agent")
	})
	eventually(t, 20*time.Second, "the agent's retry with the revoked certificate refused", func() bool {
		// The first line is the session's end; a retry's refusal says the
		// tap's words.
		return agent.logged("invalid or missing credential")
	})
	if s := m.caddyLog(); !strings.Contains(s, "ended the sessions whose credential is gone, changed or revoked") {
		t.Error("the node did not log the sessions it ended on the reload")
	}

	// Renew into the same files: the agent's next attempt uses them.
	renewed := m.issueCert(t, "agent-1", certs, "--force")
	if renewed.serial == first.serial {
		t.Fatal("the renewal kept the serial")
	}
	eventually(t, 45*time.Second, "app.test served again with the renewed certificate", func() bool {
		code, body := m.get("app.test", "/")
		return code == 200 && strings.Contains(body, "Hello from mtls-app")
	})
	if agent.exited() {
		t.Fatal("the agent exited")
	}
	if s := m.session(t, "mtls-agent"); s.Credential != "team-a" {
		t.Fatalf("renewed session: credential %q", s.Credential)
	}
	// Each issuance is logged, never its key.
	log := m.caddyLog()
	if !strings.Contains(log, "sluice: issued a client certificate") || !strings.Contains(log, renewed.serial) {
		t.Error("Caddy did not log the issuance with its serial")
	}
	if strings.Contains(log, "PRIVATE KEY") {
		t.Error("Caddy logged a key")
	}
}

// mtlsCaddy is a caddy binary running the mTLS config.
type mtlsCaddy struct {
	bin, caddyfile, dataDir string
	admin, http, control    int
	out                     *syncBuffer
}

// startMTLSCaddy runs Caddy with the mTLS config, its data and config
// directories temporary, and the pki app's CA kept out of the trust store,
// and waits for its admin API.
func startMTLSCaddy(t *testing.T, bin string) *mtlsCaddy {
	t.Helper()
	home := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(home, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(home, "config"))
	t.Setenv("HOME", home)
	m := &mtlsCaddy{bin: bin, caddyfile: filepath.Join(home, "Caddyfile"), dataDir: filepath.Join(home, "storage"),
		admin: freePort(t), http: freePort(t), control: freePort(t)}
	m.write(t)
	// skip_install_trust must reach the CA the control plane uses: the
	// test must never touch the machine's trust store.
	adapted, err := exec.Command(bin, "adapt", "--config", m.caddyfile, "--adapter", "caddyfile").CombinedOutput()
	if err != nil || !strings.Contains(string(adapted), `"local":{"name":"Sluice mTLS Test CA","install_trust":false}`) {
		t.Fatalf("caddy adapt: %v; want the local CA with install_trust false:\n%s", err, adapted)
	}
	m.out = new(syncBuffer)
	cmd := exec.Command(bin, "run", "--config", m.caddyfile, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = m.out, m.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("caddy output:\n%s", m.out.String())
		}
	})
	eventually(t, 20*time.Second, "Caddy's sluice node ready", func() bool {
		select {
		case <-done:
			t.Fatalf("caddy exited:\n%s", m.out.String())
		default:
		}
		code, _ := m.adminGet("/sluice/ready")
		return code == 200
	})
	return m
}

// write writes the Caddyfile, revoking the serials given.
func (m *mtlsCaddy) write(t *testing.T, revoked ...string) {
	t.Helper()
	revoke := ""
	if len(revoked) > 0 {
		revoke = "\n\t\t\trevoke " + strings.Join(revoked, " ")
	}
	text := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
	storage file_system %s
	skip_install_trust
	pki {
		ca local {
			name "Sluice mTLS Test CA"
		}
	}
	http_port %d
	sluice {
		listen 127.0.0.1:%d
		tls internal 127.0.0.1
		client_auth local {
			require%s
		}
		credential team-a {
			client_identity urn:sluice:team-a
			hosts app.test
		}
	}
}

http://:%d {
	bind 127.0.0.1
	sluice
}
`, m.admin, m.dataDir, m.http, m.control, revoke, m.http)
	if err := os.WriteFile(m.caddyfile, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// reload rewrites the Caddyfile revoking serials and runs `caddy reload`.
func (m *mtlsCaddy) reload(t *testing.T, revoked ...string) {
	t.Helper()
	m.write(t, revoked...)
	out, err := exec.Command(m.bin, "reload", "--config", m.caddyfile, "--adapter", "caddyfile").CombinedOutput()
	if err != nil {
		t.Fatalf("caddy reload: %v\n%s", err, out)
	}
}

func (m *mtlsCaddy) caddyLog() string { return m.out.String() }

func (m *mtlsCaddy) serverURL() string { return fmt.Sprintf("grpcs://127.0.0.1:%d", m.control) }

// issued is what `caddy sluice issue-cert` printed.
type issued struct{ serial, identity, notAfter string }

// issueCert runs `caddy sluice issue-cert` for team-a, finding the admin
// API through --config as `caddy reload` does.
func (m *mtlsCaddy) issueCert(t *testing.T, name, dir string, extra ...string) issued {
	t.Helper()
	args := append([]string{"sluice", "issue-cert", "--credential", "team-a", "--name", name, "--lifetime", "24h",
		"--out", dir, "--config", m.caddyfile, "--adapter", "caddyfile"}, extra...)
	out, err := exec.Command(m.bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("caddy sluice issue-cert: %v\n%s", err, out)
	}
	fields := map[string]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	got := issued{serial: fields["serial"], identity: fields["identity"], notAfter: fields["not_after"]}
	if got.serial == "" || got.identity != "urn:sluice:team-a" || got.notAfter == "" {
		t.Fatalf("issue-cert printed:\n%s", out)
	}
	for _, f := range []string{name + ".crt", name + ".key", "ca.crt"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("issue-cert did not write %s: %v", f, err)
		}
	}
	return got
}

// get requests path of host through Caddy's HTTP port.
func (m *mtlsCaddy) get(host, path string) (int, string) {
	req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d%s", m.http, path), nil)
	req.Host = host
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// download fetches size bytes of the upstream's /download through Caddy.
func (m *mtlsCaddy) download(t *testing.T, host string, size int) (int, int64) {
	t.Helper()
	req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/download?size=%d", m.http, size), nil)
	req.Host = host
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, n
}

// adminGet asks Caddy's admin API.
func (m *mtlsCaddy) adminGet(path string) (int, []byte) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(fmt.Sprintf("http://127.0.0.1:%d%s", m.admin, path))
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// sessions are the node's sessions by agent id (GET /sluice/status).
func (m *mtlsCaddy) sessions(t *testing.T) map[string]caddymodule.SessionStatus {
	t.Helper()
	code, body := m.adminGet("/sluice/status?listen=" + url.QueryEscape(fmt.Sprintf("127.0.0.1:%d", m.control)))
	if code != 200 {
		t.Fatalf("GET /sluice/status: %d %s", code, body)
	}
	var st caddymodule.StatusResponse
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatal(err)
	}
	out := map[string]caddymodule.SessionStatus{}
	for _, n := range st.Nodes {
		for _, s := range n.Sessions {
			out[s.AgentID] = s
		}
	}
	return out
}

func (m *mtlsCaddy) hasSession(t *testing.T, id string) bool {
	_, ok := m.sessions(t)[id]
	return ok
}

// session is the node's session of agent id; the test fails without one.
func (m *mtlsCaddy) session(t *testing.T, id string) caddymodule.SessionStatus {
	t.Helper()
	s, ok := m.sessions(t)[id]
	if !ok {
		t.Fatalf("no session of %s", id)
	}
	return s
}

// foreignClientCert writes a client certificate for identity (and its key)
// signed by a CA made here, which the node does not know.
func foreignClientCert(t *testing.T, dir, identity string) (certPath, keyPath string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "Foreign Root"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	u, _ := url.Parse(identity)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leafTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "foreign"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(12 * time.Hour), URIs: []*url.URL{u},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, leafTmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPath, keyPath = filepath.Join(dir, "foreign.crt"), filepath.Join(dir, "foreign.key")
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certPath, keyPath
}
