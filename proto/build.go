package tunnelpb

import (
	"runtime"
	"runtime/debug"
	"sync"
)

// ModulePath is sluice's Go module, whose version names a build.
const ModulePath = "github.com/sluice-tunnel/sluice"

// moduleVersion is sluice's module version in this binary's build info:
// the main module's in sluice-agent, a dependency's in a Caddy built with
// xcaddy. It is read once: the build info does not change, and a node
// answers every Advertise with it.
var moduleVersion = sync.OnceValue(func() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	return versionIn(bi)
})

// versionIn finds sluice's module version in bi; "" when it is absent or
// a development build's "(devel)".
func versionIn(bi *debug.BuildInfo) string {
	v := ""
	if bi.Main.Path == ModulePath {
		v = bi.Main.Version
	}
	for _, d := range bi.Deps {
		if d.Path == ModulePath {
			v = d.Version
			if d.Replace != nil && d.Replace.Version != "" {
				v = d.Replace.Version
			}
		}
	}
	if v == "(devel)" {
		return ""
	}
	return v
}

// Build returns "<program> <version> (<go version>)", the form of
// Advertise.build and AdvertiseAck.build, both ends building it alike so
// that an operator reads one against the other. version, when empty, is
// sluice's module version from the build info, else "devel".
func Build(program, version string) string {
	if version == "" {
		version = moduleVersion()
	}
	if version == "" {
		version = "devel"
	}
	return program + " " + version + " (" + runtime.Version() + ")"
}
