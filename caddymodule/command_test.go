package caddymodule

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// fakeIssueAdmin is an admin API whose /sluice/certificates answers with
// a fixed certificate, or 400 for the credential "nobody"; it counts the
// requests and keeps the last.
type fakeIssueAdmin struct {
	addr     string
	requests atomic.Int64
	mu       sync.Mutex // the handler's and the test's
	last     IssueRequest
	ca       string
}

func (f *fakeIssueAdmin) lastRequest() IssueRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.last
}

func (f *fakeIssueAdmin) setCA(ca string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ca = ca
}

func newFakeIssueAdmin(t *testing.T) *fakeIssueAdmin {
	t.Helper()
	f := &fakeIssueAdmin{ca: "-----BEGIN CERTIFICATE-----\nroot\n-----END CERTIFICATE-----\n"}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.requests.Add(1)
		f.mu.Lock()
		defer f.mu.Unlock()
		if r.Method != http.MethodPost || r.URL.Path != "/sluice/certificates" {
			http.Error(w, "wrong request", http.StatusNotFound)
			return
		}
		if err := json.NewDecoder(r.Body).Decode(&f.last); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if f.last.Credential == "nobody" {
			http.Error(w, `{"error": "credential: no credential named \"nobody\""}`, http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(IssuedCertificate{
			Certificate: "-----BEGIN CERTIFICATE-----\nleaf " + f.last.Name + "\n-----END CERTIFICATE-----\n",
			Key:         "-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n",
			CA:          f.ca, Serial: "0a:0b", NotAfter: "2030-01-02T03:04:05Z",
			Identity: "urn:sluice:" + f.last.Credential, Credential: f.last.Credential,
		})
	}))
	t.Cleanup(srv.Close)
	f.addr = strings.TrimPrefix(srv.URL, "http://")
	return f
}

// runIssueCertCmd runs `caddy sluice issue-cert` with args and returns its
// output and error.
func runIssueCertCmd(args ...string) (string, error) {
	cmd := issueCertCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

// TestIssueCertCommand: issue-cert sends the flags to the admin API, writes
// <name>.crt and <name>.key with mode 0600 and ca.crt, and prints the
// serial, identity, expiry and paths; it refuses to overwrite unless
// --force (before asking the admin API), and shares ca.crt between
// certificates of the same CA.
func TestIssueCertCommand(t *testing.T) {
	admin := newFakeIssueAdmin(t)
	dir := t.TempDir()
	out, err := runIssueCertCmd("--address", admin.addr, "--credential", "team-a", "--lifetime", "48h", "--out", dir)
	if err != nil {
		t.Fatalf("issue-cert: %v\n%s", err, out)
	}
	if admin.lastRequest() != (IssueRequest{Credential: "team-a", Lifetime: "48h"}) {
		t.Errorf("request %+v", admin.lastRequest())
	}
	for _, want := range []string{"0a:0b", "urn:sluice:team-a", "2030-01-02T03:04:05Z",
		filepath.Join(dir, "team-a.crt"), filepath.Join(dir, "team-a.key"), filepath.Join(dir, "ca.crt")} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for name, mode := range map[string]os.FileMode{"team-a.crt": 0o600, "team-a.key": 0o600, "ca.crt": 0o644} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", name, st.Mode().Perm(), mode)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "team-a.key")); !strings.Contains(string(b), "PRIVATE KEY") {
		t.Errorf("key file %q", b)
	}

	// Again: refused before any request, files untouched.
	before := admin.requests.Load()
	if _, err := runIssueCertCmd("--address", admin.addr, "--credential", "team-a", "--out", dir); err == nil ||
		!strings.Contains(err.Error(), "--force") {
		t.Fatalf("overwrite without --force: %v", err)
	}
	if admin.requests.Load() != before {
		t.Fatal("a refused run asked the admin API")
	}
	// A second certificate of the same CA into the same directory.
	if _, err := runIssueCertCmd("--address", admin.addr, "--credential", "team-a", "--name", "laptop-2", "--out", dir); err != nil {
		t.Fatalf("second name, same CA: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "laptop-2.crt")); !strings.Contains(string(b), "leaf laptop-2") {
		t.Errorf("laptop-2.crt %q", b)
	}
	// --force renews in place.
	if _, err := runIssueCertCmd("--address", admin.addr, "--credential", "team-a", "--name", "laptop-2", "--out", dir, "--force"); err != nil {
		t.Fatalf("--force: %v", err)
	}
	// Another CA does not replace ca.crt silently.
	admin.setCA("-----BEGIN CERTIFICATE-----\nother root\n-----END CERTIFICATE-----\n")
	if _, err := runIssueCertCmd("--address", admin.addr, "--credential", "team-a", "--name", "laptop-3", "--out", dir); err == nil ||
		!strings.Contains(err.Error(), "another CA") {
		t.Fatalf("another CA into the same directory: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "laptop-3.key")); err == nil {
		t.Error("the refused run wrote its key")
	}
}

// TestIssueCertCommandRefusals: what the command cannot do it says
// before asking the admin API, and the admin API's refusals come through.
func TestIssueCertCommandRefusals(t *testing.T) {
	admin := newFakeIssueAdmin(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{}, "--credential is required"},
		{[]string{"--credential", "team-a", "--name", "../escape"}, "name:"},
		{[]string{"--credential", "team/a"}, "--name"},
		{[]string{"--credential", "team-a", "stray"}, "unknown command"},
	} {
		if _, err := runIssueCertCmd(append([]string{"--address", admin.addr, "--out", dir}, tc.args...)...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
	if n := admin.requests.Load(); n != 0 {
		t.Errorf("%d requests for refused runs", n)
	}
	_, err := runIssueCertCmd("--address", admin.addr, "--out", dir, "--credential", "nobody")
	if err == nil || !strings.Contains(err.Error(), "HTTP 400") || !strings.Contains(err.Error(), "nobody") {
		t.Errorf("the admin API's refusal: %v", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("refused runs left files: %v", entries)
	}
}

// TestVersionCommand: `caddy sluice version` prints the node's build line
// (the one agents log as node_build) first, then the build info; it is
// registered beside issue-cert.
func TestVersionCommand(t *testing.T) {
	var out bytes.Buffer
	cmd := versionCommand()
	cmd.SetOut(&out)
	cmd.SetArgs(nil)
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	first, rest, _ := strings.Cut(out.String(), "\n")
	if want := tunnelpb.Build("sluice-node", ""); first != want {
		t.Errorf("first line %q, want %q", first, want)
	}
	// The test binary's build info names its main package.
	if !strings.HasPrefix(rest, "path ") {
		t.Errorf("build info lines:\n%s", rest)
	}
	cmd = versionCommand()
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"extra"})
	if err := cmd.Execute(); err == nil {
		t.Error("version took an argument")
	}
}
