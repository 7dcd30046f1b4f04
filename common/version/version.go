// Package version owns the version string both agents report.
//
// The string is the dstack protocol level Tandem implements followed by our
// own release as a PEP 440 local label, e.g. "0.21.2+tandem.0.1.0". The dstack
// server parses that as 0.21.2 and gates features on it.
package version

// ProtocolLevel is the dstack release whose agent protocol we implement.
// 0.21.3 promises that running tasks survive a shim restart (the server
// restarts such shims with tasks running): shim/task's records and Restore
// keep that promise.
const ProtocolLevel = "0.21.3"

// tandem is our own release, set at build time with
// -ldflags "-X github.com/tandem-run/tandem/common/version.tandem=0.1.0".
// It is the one package-level variable the linker can write.
var tandem = "dev"

// String returns the full reported version.
func String() string { return ProtocolLevel + "+tandem." + tandem }

// Tandem returns our own release alone.
func Tandem() string { return tandem }
