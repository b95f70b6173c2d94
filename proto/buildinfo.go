package tunnelpb

import (
	"runtime/debug"
	"strings"
)

// VersionText is what `sluice-agent version` and `caddy sluice version`
// print, as `caddy version` prints Caddy's: the build line (Build), then
// from the binary's build info the main package, sluice's module (its
// version, checksum and any replacement), the modules named in also (Caddy
// and caddy-l4 in a node), and the VCS stamp of a build from a checkout.
func VersionText(program, version string, also ...string) string {
	var b strings.Builder
	b.WriteString(Build(program, version))
	b.WriteByte('\n')
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		b.WriteString("no build info (not built with module support)\n")
		return b.String()
	}
	writeBuildInfo(&b, bi, also)
	return b.String()
}

// writeBuildInfo writes the lines of VersionText after the build line.
func writeBuildInfo(b *strings.Builder, bi *debug.BuildInfo, also []string) {
	b.WriteString("path " + bi.Path + "\n")
	if bi.Main.Path == ModulePath {
		writeModule(b, &bi.Main)
	}
	for _, want := range append([]string{ModulePath}, also...) {
		for _, d := range bi.Deps {
			if d.Path == want {
				writeModule(b, d)
			}
		}
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs", "vcs.revision", "vcs.time", "vcs.modified":
			b.WriteString(s.Key + " " + s.Value + "\n")
		}
	}
}

// writeModule writes one module line: "module <path> <version> [<sum>]
// [=> <replacement> [<version>]]". The replacement matters: an xcaddy
// build of a checkout names sluice's directory there.
func writeModule(b *strings.Builder, m *debug.Module) {
	line := []string{"module", m.Path, m.Version}
	if m.Sum != "" {
		line = append(line, m.Sum)
	}
	if r := m.Replace; r != nil {
		line = append(line, "=>", r.Path)
		if r.Version != "" {
			line = append(line, r.Version)
		}
	}
	b.WriteString(strings.Join(line, " ") + "\n")
}
