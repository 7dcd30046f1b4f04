// Package version owns the version strings both agents report.
//
// The rule: an agent reports exactly the dstack release it is built as, and
// nothing else, in /api/healthcheck, in /api/components (the shim runs the
// binaries with --version) and in --version. The dstack server compares
// those strings for equality with its own release (DSTACK_VERSION, or
// DSTACK_SHIM_VERSION / DSTACK_RUNNER_VERSION / the *_VERSION_URL files on
// a dev server): any other string, "0.21.3+tandem.0.1.0" included, makes it
// re-install both components and restart the shim on every instance check,
// forever. It also gates protocol features on that version, so it must be a
// dstack release whose protocol we implement.
//
// Tandem's own release travels beside it: the tandem_version field of the
// healthcheck JSON (the server ignores fields it does not know) and the
// --version-verbose flag.
package version

import (
	"fmt"
	"runtime"
)

// ProtocolLevel is the newest dstack release whose agent protocol we
// implement: the default for the reported version.
const ProtocolLevel = "0.21.3"

// dstack and tandem are set at build time with
// -ldflags "-X github.com/tandem-run/tandem/common/version.dstack=0.21.3
// -X github.com/tandem-run/tandem/common/version.tandem=0.1.0"; they are
// the only package-level variables, because the linker can write only those.
var (
	dstack = ""
	tandem = "dev"
)

// String returns the reported version: the dstack release the agents are
// built as.
func String() string {
	if dstack == "" {
		return ProtocolLevel
	}
	return dstack
}

// Tandem returns Tandem's own release.
func Tandem() string { return tandem }

// Verbose is the long form for --version-verbose: what the server sees,
// then Tandem's release and the toolchain.
func Verbose(component string) string {
	return fmt.Sprintf("%s version %s\ntandem %s\n%s %s/%s\n", component, String(), tandem, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
