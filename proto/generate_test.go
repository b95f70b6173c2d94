package tunnelpb

import (
	"bytes"
	"fmt"
	"go/build"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// generatedFiles are the files proto/gen.sh writes from tunnel.proto.
var generatedFiles = []string{"tunnel.pb.go", "tunnel_grpc.pb.go"}

// protocLine matches the header line that names the protoc version:
// "// \tprotoc        v3.21.12" (protoc-gen-go) and
// "// - protoc             v3.21.12" (protoc-gen-go-grpc).
var protocLine = regexp.MustCompile(`(?m)^//\s+(?:-\s+)?protoc\s+\S+[ \t]*\r?\n`)

// pluginLine matches the header line that names a plugin's version.
var pluginLine = func(name string) *regexp.Regexp {
	return regexp.MustCompile(`(?m)^//\s+(?:-\s+)?` + regexp.QuoteMeta(name) + `\s+(\S+)[ \t]*$`)
}

// TestGeneratedCodeIsCurrent regenerates the Go code from tunnel.proto with
// protoc and the pinned plugins and compares it with the committed files,
// so that an edit of tunnel.proto without running proto/gen.sh fails.
func TestGeneratedCodeIsCurrent(t *testing.T) {
	ci := os.Getenv("CI") != ""
	// missing skips the test, or fails it on CI where the tools must exist.
	missing := func(format string, args ...any) {
		t.Helper()
		msg := fmt.Sprintf(format, args...)
		if ci {
			t.Fatalf("%s (CI is set: install the pinned tools, see proto/gen.sh)", msg)
		}
		t.Skip(msg)
	}

	protoc, err := exec.LookPath("protoc")
	if err != nil {
		t.Skip("protoc not on PATH; install protoc 3.21.12 to check the generated code")
	}
	out, err := exec.Command(protoc, "--version").Output()
	if err != nil {
		t.Skipf("protoc --version: %v", err)
	}
	protocName := strings.TrimSpace(string(out)) // "libprotoc 3.21.12"

	committed := map[string][]byte{}
	for _, name := range generatedFiles {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		committed[name] = b
	}

	// The plugins must be the versions the committed headers name, or the
	// comparison says nothing about tunnel.proto.
	plugins := []struct{ name, file string }{
		{"protoc-gen-go", "tunnel.pb.go"},
		{"protoc-gen-go-grpc", "tunnel_grpc.pb.go"},
	}
	args := []string{}
	for _, p := range plugins {
		m := pluginLine(p.name).FindSubmatch(committed[p.file])
		if m == nil {
			t.Fatalf("%s: no %q version line in the header", p.file, p.name)
		}
		want := normVersion(string(m[1]))
		cands := pluginCandidates(p.name)
		if len(cands) == 0 {
			missing("%s not found on PATH, in $(go env GOBIN) or in $(go env GOPATH)/bin; run proto/gen.sh, which installs %s %s",
				p.name, p.name, want)
		}
		path := ""
		var seen []string
		for _, c := range cands {
			vout, err := exec.Command(c, "--version").Output()
			got := normVersion(lastField(string(vout)))
			if err == nil && got == want {
				path = c
				break
			}
			seen = append(seen, fmt.Sprintf("%s (%s)", c, got))
		}
		if path == "" {
			missing("no %s %s (the version of the committed code) found, only %s; run proto/gen.sh, which installs it",
				p.name, want, strings.Join(seen, ", "))
		}
		args = append(args, "--plugin="+p.name+"="+path)
	}

	dir := t.TempDir()
	args = append(args,
		"--go_out="+dir, "--go_opt=paths=source_relative",
		"--go-grpc_out="+dir, "--go-grpc_opt=paths=source_relative",
		"tunnel.proto")
	cmd := exec.Command(protoc, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("protoc: %v\n%s", err, stderr.String())
	}

	for _, name := range generatedFiles {
		fresh, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		old := committed[name]
		if bytes.Equal(fresh, old) {
			continue
		}
		// A different protoc changes only the header's protoc line: compare
		// without it.
		if bytes.Equal(protocLine.ReplaceAll(fresh, nil), protocLine.ReplaceAll(old, nil)) {
			continue
		}
		if was, now := protocLine.Find(old), protocLine.Find(fresh); !bytes.Equal(was, now) {
			t.Skipf("proto/%s differs from what the local %s generates, but it was generated with another protoc (%q, here %q); "+
				"cannot tell whether tunnel.proto changed. Use the protoc the header names, or regenerate with proto/gen.sh (pinned: protoc 3.21.12)",
				name, protocName, strings.TrimSpace(string(was)), strings.TrimSpace(string(now)))
		}
		t.Errorf("proto/%s is not what tunnel.proto generates (first difference: %s); run proto/gen.sh",
			name, firstDiff(old, fresh))
	}
}

// pluginCandidates returns the executables named name on PATH, in GOBIN
// and in GOPATH/bin, in that order and without duplicates.
func pluginCandidates(name string) []string {
	exe := name
	if runtime.GOOS == "windows" {
		exe += ".exe"
	}
	dirs := filepath.SplitList(os.Getenv("PATH"))
	if gobin := goEnv("GOBIN"); gobin != "" {
		dirs = append(dirs, gobin)
	}
	gopath := goEnv("GOPATH")
	if gopath == "" {
		gopath = build.Default.GOPATH
	}
	for _, d := range filepath.SplitList(gopath) {
		dirs = append(dirs, filepath.Join(d, "bin"))
	}
	var out []string
	seen := map[string]bool{}
	for _, d := range dirs {
		if d == "" {
			continue
		}
		p := filepath.Join(d, exe)
		fi, err := os.Stat(p)
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 && runtime.GOOS != "windows" {
			continue
		}
		if abs, err := filepath.Abs(p); err == nil {
			p = abs
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out
}

func goEnv(key string) string {
	out, err := exec.Command("go", "env", key).Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// lastField returns the last whitespace-separated field of s.
func lastField(s string) string {
	f := strings.Fields(s)
	if len(f) == 0 {
		return ""
	}
	return f[len(f)-1]
}

// normVersion writes versions as vX.Y.Z ("1.6.2" and "v1.6.2" are equal).
func normVersion(v string) string {
	if v != "" && !strings.HasPrefix(v, "v") {
		return "v" + v
	}
	return v
}

// firstDiff describes the first line where a and b differ.
func firstDiff(a, b []byte) string {
	al := strings.Split(string(a), "\n")
	bl := strings.Split(string(b), "\n")
	for i := 0; i < len(al) || i < len(bl); i++ {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y || i >= len(al) || i >= len(bl) {
			return fmt.Sprintf("line %d: committed %q, generated %q", i+1, x, y)
		}
	}
	return "none"
}
